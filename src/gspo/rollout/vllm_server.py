"""rollout.engine=vllm_server: a `vllm serve` process of gspo's own on 127.0.0.1, sampled through its
OpenAI-compatible API with token ids (gspo.rollout.openai.OpenAIBackend), and given the trainer's weights
after every step through files: the policy (LoRA merged) written as safetensors into the folder the server
started from, then vLLM's own in-place reload of that folder, called over HTTP (its dev-mode
`/collective_rpc` with `reload_weights`), and its prefix cache reset (docs/vllm.md).
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


class VLLMServer:
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
        write_model_folder(model, self.directory)
        tokenizer.save_pretrained(self.directory)
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
            *("--logprobs-mode", "processed_logprobs", "--return-tokens-as-token-ids"),
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

    def _post(self, path: str, body: dict) -> None:
        request = urllib.request.Request(
            self.root + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            urllib.request.urlopen(request, timeout=600).close()
        except (OSError, urllib.error.HTTPError) as error:
            self._check_alive()
            raise ServerError(f"{self.root}{path}: the weight sync failed: {error}") from error

    def reload(self) -> None:
        """Reload the weights from the folder in place, then forget the prompts computed with the old ones."""
        self._check_alive()
        self._post(
            "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(self.directory)}}
        )
        self._post("/reset_prefix_cache", {})

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


@dataclass
class FileReload:
    """The weight sync of a VLLMServer: the policy's weights (LoRA merged) replace the server folder's
    (gspo.rollout.vllm_engine.write_model_folder), then the server reloads them."""

    server: VLLMServer

    def __call__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, step: int) -> None:
        write_model_folder(model, self.server.directory)
        self.server.reload()


def server_sampler(server: VLLMServer, tokenizer: PreTrainedTokenizerBase, timeout: float) -> OpenAIBackend:
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
