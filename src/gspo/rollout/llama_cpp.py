"""A llama.cpp server of our own (llama-cpp-python's OpenAI-compatible server of a GGUF file on 127.0.0.1),
and its weight sync: the policy exported as GGUF and the server restarted on it (docs/llama_cpp_sync.md).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gspo.rollout.openai import ServerError
from gspo.rollout.processes import PREEXEC


def require_llama_cpp() -> None:
    """An ImportError naming the install command when llama-cpp-python is missing."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise ImportError(
            'rollout.engine=llama_cpp needs llama-cpp-python: CMAKE_ARGS="-DGGML_NATIVE=OFF" pip install '
            "'gspo[server]' (or set rollout.engine=hf)"
        )


class LlamaCppServer:
    """llama-cpp-python's OpenAI-compatible server of a GGUF file on 127.0.0.1, restartable on a new file at
    the same URL (`restart`); `url` is the base URL. Stopped by `close()`, on leaving a `with`, or at exit.

    Needs `pip install 'gspo[server]'` (llama-cpp-python; on CPUs where its native build crashes with
    "Illegal instruction", build it with CMAKE_ARGS="-DGGML_NATIVE=OFF"). Raises ImportError when it is
    missing, and ServerError with the server's output when it does not come up within `startup_timeout`
    seconds. The server runs
    with OMP_WAIT_POLICY=PASSIVE: llama.cpp's spinning OpenMP workers stall badly on a CPU shared with the
    trainer.
    """

    def __init__(
        self,
        model_file: str | Path,
        *,
        n_ctx: int = 2048,
        threads: int = 1,
        startup_timeout: float = 120.0,
        nice: int = 0,
    ) -> None:
        require_llama_cpp()
        with socket.socket() as probe:  # a free port
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.n_ctx, self.threads, self.startup_timeout, self.nice = n_ctx, threads, startup_timeout, nice
        self.process: subprocess.Popen | None = None
        self.restarts = 0
        atexit.register(self.close)
        self._start(model_file)

    def _start(self, model_file: str | Path) -> None:
        command = [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            str(model_file),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--n_ctx",
            str(self.n_ctx),
            "--n_threads",
            str(self.threads),
            "--n_threads_batch",
            str(self.threads),
            "--logits_all",
            "true",
            "--interrupt_requests",
            "false",
            "--verbose",
            "false",
        ]
        if self.nice:
            command = ["nice", "-n", str(self.nice), *command]
        # the server's output goes to a file, not a pipe: a full pipe would block the server
        self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed in close(), with the process)
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        self.process = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            preexec_fn=PREEXEC,
        )
        try:
            _wait_until_up(self.process, self._log, self.url, self.startup_timeout)
        except ServerError:
            self.close()
            raise

    def restart(self, model_file: str | Path) -> None:
        """Serve `model_file` instead, at the same URL (the old process is stopped first)."""
        self.close()
        self._start(model_file)
        self.restarts += 1

    def close(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None
            self._log.close()

    def __enter__(self) -> LlamaCppServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def llama_cpp_server(
    model_file: str | Path,
    *,
    n_ctx: int = 2048,
    threads: int = 1,
    startup_timeout: float = 120.0,
    nice: int = 0,
) -> Iterator[str]:
    """Serve a GGUF file with a `LlamaCppServer` for the duration of a `with`; yields the base URL."""
    with LlamaCppServer(
        model_file, n_ctx=n_ctx, threads=threads, startup_timeout=startup_timeout, nice=nice
    ) as server:
        yield server.url


@dataclass
class GGUFReload:
    """Weight sync for a `LlamaCppServer`: every `every` steps, write the policy as a GGUF file of weight type
    `quant` to `directory`/policy.gguf (LoRA merged into a copy) and restart the server on it.

    source: the GGUF the run started from, whose metadata and tokenizer are carried over (None: built from
    the model's config and tokenizer; gspo.models.gguf_export). Between syncs the server samples from
    weights up to `every - 1` steps old: the trainer recomputes the old-policy log-probs, and
    `train.sampler_correction` corrects for the gap. docs/llama_cpp_sync.md measures the cost of a sync.
    """

    server: LlamaCppServer
    directory: str | Path
    every: int = 1
    quant: str = "f16"
    source: str | Path | None = None
    seconds: list[float] = field(default_factory=list)
    """Wall time of each sync (export + restart)."""

    def __call__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, step: int) -> None:
        if step % self.every:
            return
        start = time.perf_counter()
        path = export_policy(model, tokenizer, Path(self.directory) / "policy.gguf", self.quant, self.source)
        self.server.restart(path)
        self.seconds.append(time.perf_counter() - start)


def export_policy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    path: Path,
    quant: str,
    source: str | Path | None,
) -> Path:
    """The policy as a GGUF file for llama.cpp; LoRA adapters are merged into a copy (the trainer keeps its own)."""
    from gspo.models import is_lora
    from gspo.models.gguf_export import write_gguf
    from gspo.models.loading import quiet_peft

    if is_lora(model):
        with quiet_peft():
            model = copy.deepcopy(model).merge_and_unload()
    return write_gguf(model, tokenizer, path, quant=quant, source=source)


def _wait_until_up(process: subprocess.Popen, log: Any, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            log.seek(0)
            output = log.read()
            raise ServerError(
                f"llama-cpp-python's server exited with {process.returncode}:\n{output[-2000:]}"
            )
        try:
            with urllib.request.urlopen(f"{url}/models", timeout=5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise ServerError(
                    f"llama-cpp-python's server did not answer on {url} within {timeout:.0f}s"
                ) from None
            time.sleep(0.5)
