"""Rollouts from any OpenAI-compatible server (vLLM, SGLang, llama.cpp) via /v1/completions.

`OpenAIBackend` is a `Sampler`: G samples per prompt with the engine's per-token log-probs, its tokens
mapped to the trainer's tokenizer and checked (an `AlignmentError` rather than a silent misalignment), in a
bounded thread pool with retries and a deadline, and weight sync as a pluggable callable.
docs/rollout_servers.md describes the alignment rules, the transport and weight sync.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import importlib.util
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gspo.rollout.samplers import Rollouts, tokenize_prompts

TRANSIENT_HTTP = {408, 429, 500, 502, 503, 504}
DEFAULT_SAMPLING = {"top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0}
"""Request fields that switch off llama.cpp's default truncations/penalties (vLLM accepts top_k/min_p too)."""


class ServerError(RuntimeError):
    """The server did not answer usefully (down, overloaded, timed out, or rejected the request)."""


class AlignmentError(ValueError):
    """The server's tokens or prompt do not line up with the trainer's tokenizer."""


class WeightSync(Protocol):
    """Makes the server sample from the trainer's current weights; called after an update."""

    def __call__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, step: int) -> None: ...


@dataclass
class SaveAndReload:
    """Save the policy to `directory/step-N` (HF checkpoint or LoRA adapter), then call `reload(path)`."""

    directory: str | Path
    reload: Callable[[Path], None]

    def __call__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, step: int) -> None:
        from gspo.models import save_model

        path = Path(self.directory) / f"step-{step}"
        save_model(model, tokenizer, path)
        self.reload(path)


@dataclass
class OpenAIBackend:
    """G samples per prompt from an OpenAI-compatible /v1/completions endpoint (module docstring).

    base_url: the API root, e.g. "http://127.0.0.1:8000/v1"; tokenizer: the trainer's tokenizer;
    model: the served model name (None: the server's default); max_concurrency: requests in flight;
    timeout: seconds per request, retries included; max_retries: retries of a transient failure;
    send_token_ids: send prompts as token ids (vLLM, SGLang) instead of text; sampling: extra request
    fields (defaults: DEFAULT_SAMPLING); logprobs_tempered: the server's log-probs already include the
    temperature; api_key: sent as a bearer token; weight_sync: see `sync_weights`.
    """

    base_url: str
    tokenizer: PreTrainedTokenizerBase
    model: str | None = None
    max_concurrency: int = 4
    timeout: float = 120.0
    max_retries: int = 5
    send_token_ids: bool = False
    sampling: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_SAMPLING))
    logprobs_tempered: bool = False
    api_key: str | None = None
    weight_sync: WeightSync | None = None
    misaligned: Literal["raise", "resample"] = "raise"
    resampled: int = 0
    """Samples drawn again because they could not be aligned (with misaligned="resample")."""
    current: bool = False
    """An external engine: its log-probs are not the trainer's own (other kernels, dtype, quantisation)."""

    # ---- transport ----------------------------------------------------------------------------------
    def post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        """POST JSON to base_url + path, retrying transient failures within `timeout` seconds."""
        url = self.base_url.rstrip("/") + path
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(payload).encode()
        deadline = time.monotonic() + self.timeout
        last: str = "no attempt"
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or attempt > self.max_retries:
                break
            attempt += 1
            request = urllib.request.Request(url, data=data, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=remaining) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as error:
                body = error.read().decode(errors="replace")[:500]
                if error.code not in TRANSIENT_HTTP:
                    raise ServerError(f"{url} rejected the request: HTTP {error.code}: {body}") from None
                last = f"HTTP {error.code}: {body}"
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as error:
                last = f"{type(error).__name__}: {getattr(error, 'reason', error)}"
            # exponential backoff with jitter, never past the deadline
            pause = min(0.25 * 2 ** (attempt - 1), 8.0) * (0.5 + random.random() / 2)
            time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
        raise ServerError(
            f"{url}: no answer after {attempt} attempt(s) in {self.timeout:.0f}s (last error: {last}). "
            "Is the server running at that address, and serving this model?"
        )

    # ---- sampling -----------------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[str],
        *,
        group_size: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> Rollouts:
        """`group_size` completions for each prompt (already templated text), with token log-probs."""
        if temperature != 1.0 and not self.logprobs_tempered:
            raise ValueError(
                f"temperature={temperature}: OpenAI-compatible servers report log-probs of the untempered "
                "distribution, which the trainer (scoring logits / temperature) would misread. Sample at "
                "temperature 1.0, or pass logprobs_tempered=True if the server reports processed log-probs"
            )
        if self.tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token: completions could not be aligned")
        prompt_ids = tokenize_prompts(self.tokenizer, prompts)
        base_seed = seed if seed is not None else random.randrange(2**31)

        def sample(j: int) -> list[tuple[list[int], list[float], bool, str]]:
            out: list[tuple[list[int], list[float], bool, str]] = []
            attempt = 0
            while len(out) < group_size:
                payload = {
                    **self.sampling,
                    "prompt": prompt_ids[j] if self.send_token_ids else prompts[j],
                    "n": group_size - len(out),
                    "max_tokens": max_new_tokens,
                    "temperature": temperature,
                    "top_p": top_p,
                    "logprobs": 1,
                    "seed": (base_seed + 1_000_003 * j + attempt) % 2**31,  # every request its own
                    "stream": False,
                }
                if self.model is not None:
                    payload["model"] = self.model
                response = self.post("/completions", payload)
                choices = sorted(response.get("choices") or [], key=lambda c: c.get("index", 0))
                if not choices:
                    raise ServerError(f"{self.base_url}: a completion response had no choices: {response}")
                if not self.send_token_ids and len(choices) == 1:
                    self._check_prompt(j, prompt_ids[j], response.get("usage") or {})
                attempt += 1
                for choice in choices[: group_size - len(out)]:
                    try:
                        out.append(self._align(j, choice))
                    except AlignmentError:
                        if self.misaligned == "raise" or self.resampled >= 10 * len(prompts) * group_size:
                            raise
                        self.resampled += 1
            return out

        with ThreadPoolExecutor(max_workers=max(1, self.max_concurrency)) as pool:
            per_prompt = list(pool.map(sample, range(len(prompts))))
        rollouts = Rollouts([], [], [], [], [])
        for j, samples in enumerate(per_prompt):
            for ids, logprobs, truncated, text in samples:
                rollouts.prompt_ids.append(prompt_ids[j])
                rollouts.completion_ids.append(ids)
                rollouts.sampler_logprobs.append(logprobs)
                rollouts.truncated.append(truncated)
                rollouts.completions.append(text)
        return rollouts

    def _check_prompt(self, j: int, prompt_ids: list[int], usage: dict[str, Any]) -> None:
        counted = usage.get("prompt_tokens")
        if counted is not None and counted != len(prompt_ids):
            raise AlignmentError(
                f"prompt {j}: the server tokenised it into {counted} tokens, the trainer into {len(prompt_ids)}: "
                "they do not share a tokenizer (or the server adds a BOS token); serve the same model, or "
                "use a server that takes token-id prompts (send_token_ids=True)"
            )

    def _token_id(self, piece: str) -> int | None:
        """The trainer's id of a reported token, or None when the piece is not exactly one token."""
        if piece.startswith("token_id:"):
            return int(piece.removeprefix("token_id:"))
        ids = self.tokenizer.encode(piece, add_special_tokens=False)
        return ids[0] if len(ids) == 1 and self.tokenizer.decode(ids) == piece else None

    def _token_ids(self, j: int, pieces: list[str], offsets: list[int] | None, text: str) -> list[int]:
        ids = [self._token_id(piece) for piece in pieces]
        k = 0
        while k < len(ids):
            if ids[k] is not None:
                k += 1
                continue
            end = k  # a run of pieces that are not one token each: re-tokenise their text together
            while end < len(ids) and ids[end] is None:
                end += 1
            if pieces[k] != "" or offsets is None or len(offsets) != len(pieces):
                raise AlignmentError(
                    f"prompt {j}, completion token {k}: the server's token {pieces[k]!r} is not one token of "
                    "the trainer's tokenizer: the server does not serve the trainer's vocabulary; use the "
                    "same model, or a server that returns token ids (vLLM: return_tokens_as_token_ids)"
                )
            stop = offsets[end] - offsets[0] if end < len(ids) else len(text)
            chunk = text[offsets[k] - offsets[0] : stop]
            guess = self.tokenizer.encode(chunk, add_special_tokens=False)
            if len(guess) != end - k or self.tokenizer.decode(guess) != chunk:
                raise AlignmentError(
                    f"prompt {j}, completion tokens {k}..{end - 1}: {end - k} tokens of partial characters "
                    f"spelling {chunk!r}, which the trainer's tokenizer splits into {len(guess)}: cannot tell "
                    "which tokens were sampled; use a server that returns token ids"
                )
            ids[k:end] = guess
            k = end
        return ids  # type: ignore[return-value]

    def _align(self, j: int, choice: dict[str, Any]) -> tuple[list[int], list[float], bool, str]:
        """(token ids, log-probs, truncated, text) of one choice, checked against the trainer's tokenizer."""
        logprobs = choice.get("logprobs") or {}
        pieces, values = logprobs.get("tokens"), logprobs.get("token_logprobs")
        if pieces is None or values is None or len(pieces) != len(values):
            raise ServerError(
                f"prompt {j}: the server returned no per-token logprobs (tokens/token_logprobs); it must "
                "support `logprobs` on /v1/completions (llama-cpp-python: start it with logits_all)"
            )
        text = choice.get("text") or ""
        ids = self._token_ids(j, pieces, logprobs.get("text_offset"), text)
        lps = [math.nan if v is None else float(v) for v in values]
        eos = self.tokenizer.eos_token_id
        # the text excludes a final EOS however the server lists it
        body = ids[:-1] if ids and ids[-1] == eos else ids
        if self.tokenizer.decode(body) != text:
            raise AlignmentError(
                f"prompt {j}: the server's tokens decode to {self.tokenizer.decode(body)!r} with the trainer's "
                f"tokenizer but its completion text is {text!r}: the two tokenizers differ"
            )
        finish = choice.get("finish_reason")
        if finish == "stop" and (not ids or ids[-1] != eos):
            ids, lps = [*ids, eos], [*lps, math.nan]  # the engine stopped on EOS without listing it
        return ids, lps, finish != "stop", text

    # ---- weights ------------------------------------------------------------------------------------
    def sync_weights(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, step: int) -> None:
        """Hand the trainer's current weights to the server (no-op without a `weight_sync`)."""
        if self.weight_sync is not None:
            self.weight_sync(model, tokenizer, step)


# ---- a local llama.cpp server, and its weight sync -------------------------------------------------------------
class LlamaCppServer:
    """llama-cpp-python's OpenAI-compatible server of a GGUF file on 127.0.0.1, restartable on a new file at
    the same URL (`restart`); `url` is the base URL. Stopped by `close()`, on leaving a `with`, or at exit.

    Needs `pip install 'gspo[server]'` (llama-cpp-python; on CPUs where its native build crashes with
    "Illegal instruction", build it with CMAKE_ARGS="-DGGML_NATIVE=OFF"). Raises RuntimeError with the
    server's output when it is missing or does not come up within `startup_timeout` seconds. The server runs
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
        if importlib.util.find_spec("llama_cpp") is None:
            raise RuntimeError(
                "llama-cpp-python is not installed: CMAKE_ARGS=\"-DGGML_NATIVE=OFF\" pip install 'gspo[server]'"
            )
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
            sys.executable, "-m", "llama_cpp.server", "--model", str(model_file), "--host", "127.0.0.1",
            "--port", str(self.port), "--n_ctx", str(self.n_ctx), "--n_threads", str(self.threads),
            "--n_threads_batch", str(self.threads), "--logits_all", "true", "--interrupt_requests", "false",
            "--verbose", "false",
        ]  # fmt: skip
        if self.nice:
            command = ["nice", "-n", str(self.nice), *command]
        # the server's output goes to a file, not a pipe: a full pipe would block the server
        self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed in close(), with the process)
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, text=True, env=env,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )  # fmt: skip
        try:
            _wait_until_up(self.process, self._log, self.url, self.startup_timeout)
        except RuntimeError:
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
    `train.sampler_is_cap` corrects for the gap. docs/llama_cpp_sync.md measures the cost of a sync.
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

    if is_lora(model):
        model = copy.deepcopy(model).merge_and_unload()
    return write_gguf(model, tokenizer, path, quant=quant, source=source)


def _die_with_parent() -> None:
    """In the server's process before exec (Linux): SIGTERM it when its parent dies, even by SIGKILL,
    so that a killed run leaves no server behind (prctl PR_SET_PDEATHSIG)."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def _wait_until_up(process: subprocess.Popen, log: Any, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            log.seek(0)
            output = log.read()
            raise RuntimeError(
                f"llama-cpp-python's server exited with {process.returncode}:\n{output[-2000:]}"
            )
        try:
            with urllib.request.urlopen(f"{url}/models", timeout=5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"llama-cpp-python's server did not answer on {url} within {timeout:.0f}s"
                ) from None
            time.sleep(0.5)
