"""Rollouts from any OpenAI-compatible server (vLLM, SGLang, llama.cpp) via /v1/completions.

`OpenAIBackend` is a `Sampler`: G samples per prompt with the engine's per-token log-probs, its tokens
mapped to the trainer's tokenizer and checked (an `AlignmentError` rather than a silent misalignment), in a
bounded thread pool with retries and a deadline, and weight sync as a pluggable callable.
docs/rollout_servers.md describes the alignment rules, the transport and weight sync.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import math
import numbers
import random
import socket
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gspo.config.rules import http_url_problem
from gspo.core.seeds import request_seed
from gspo.rollout.samplers import Rollouts, ServerError, logprob_problem, tokenize_prompts
from gspo.workers import Workers

TRANSIENT_HTTP = {408, 429, 500, 502, 503, 504}
ERROR_BODY_BYTES = 64 * 1024
"""At most this much of an error answer is read (a short excerpt goes into the message)."""
DEFAULT_SAMPLING = {"top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0}
"""Request fields that switch off llama.cpp's default truncations/penalties (vLLM accepts top_k/min_p too)."""


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


def api_key_problem(key: str) -> str | None:
    """What makes `key` unfit for an Authorization header, or None: a bearer token is printable ASCII
    without spaces. (http.client refuses the rest with an error that prints the whole header, key and all.)"""
    if any(not (33 <= ord(c) <= 126) for c in key):
        return "holds whitespace, control or non-ASCII characters (a bearer token is printable ASCII)"
    return None


@dataclass
class OpenAIBackend:
    """G samples per prompt from an OpenAI-compatible /v1/completions endpoint (module docstring).

    base_url: the API root, e.g. "http://127.0.0.1:8000/v1"; tokenizer: the trainer's tokenizer;
    model: the served model name (None: the server's default); max_concurrency: requests in flight;
    timeout: seconds per request, retries included, a deadline on the whole exchange (a server trickling
    bytes cannot stretch it); max_retries: retries of a transient failure; send_token_ids: send prompts as
    token ids (vLLM, SGLang) instead of text; sampling: extra request fields (defaults: DEFAULT_SAMPLING);
    logprobs_tempered: the server's log-probs already include the temperature; api_key: sent as a bearer
    token, to base_url's server only (redirects are not followed; the key is kept out of repr and
    messages); weight_sync: see `sync_weights`; max_response_bytes: a larger answer is refused; workers: the
    run's threads (gspo.workers), in which requests run side by side and their watchdogs fire (None: its
    own).

    The transport speaks plain HTTP(S) to base_url's host (no proxy) with http.client; an answer that is
    not the JSON object of a completion is a ServerError with the URL and an excerpt.
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
    api_key: str | None = field(default=None, repr=False)
    weight_sync: WeightSync | None = None
    misaligned: Literal["raise", "resample"] = "raise"
    resampled: int = 0
    """Samples drawn again because they could not be aligned (with misaligned="resample")."""
    current: bool = False
    """An external engine: its log-probs are not the trainer's own (other kernels, dtype, quantisation)."""
    max_response_bytes: int = 128 * 2**20
    workers: Workers | None = field(default=None, repr=False)
    _vocabulary: int | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.workers is None:
            self.workers = Workers("openai backend")
        if self.api_key is not None and (why := api_key_problem(self.api_key)):
            raise ValueError(f"api_key {why}; it is not shown")
        problem = http_url_problem(self.base_url)
        if problem is not None and "credentials" in problem:
            raise ValueError(
                "base_url holds credentials (user:password@): pass the key as api_key instead, which is "
                "kept out of messages"
            )
        if problem is not None:
            raise ValueError(f'base_url={self.base_url!r}: {problem} (e.g. "http://127.0.0.1:8000/v1")')

    # ---- transport ----------------------------------------------------------------------------------
    def post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        """POST JSON to base_url + path, retrying transient failures within `timeout` seconds."""
        url = self.base_url.rstrip("/") + path
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
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
            try:
                status, location, body = self._exchange(url, data, headers, remaining)
            except (ConnectionError, TimeoutError, OSError, http.client.HTTPException) as error:
                last = f"{type(error).__name__}: {self._redact(str(error))}"
            else:
                if 200 <= status < 300:
                    return self._json(url, body)
                if 300 <= status < 400:
                    target = urllib.parse.urlsplit(urllib.parse.urljoin(url, location or ""))
                    raise ServerError(
                        f"{url} redirected the request (HTTP {status}) to {target.scheme}://{target.netloc}: "
                        "redirects are not followed (the API key would go along); set the server URL to "
                        "the address that answers"
                    )
                if status not in TRANSIENT_HTTP:
                    raise ServerError(f"{url} rejected the request: HTTP {status}: {self._excerpt(body)}")
                last = f"HTTP {status}: {self._excerpt(body)}"
            # exponential backoff with jitter, never past the deadline
            pause = min(0.25 * 2 ** (attempt - 1), 8.0) * (0.5 + random.random() / 2)
            time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
        raise ServerError(
            f"{url}: no answer after {attempt} attempt(s) in {self.timeout:.0f}s (last error: {last}). "
            "Is the server running at that address, and serving this model?"
        )

    def _exchange(
        self, url: str, data: bytes, headers: dict[str, str], seconds: float
    ) -> tuple[int, str | None, bytes]:
        """One POST: (status, Location header, body). A watchdog shuts the socket down at the deadline,
        so no read outlives it however slowly the server sends; an answer over the size limit is refused
        as soon as it is known to be."""
        parts = urllib.parse.urlsplit(url)
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        connection = kind(parts.hostname, parts.port, timeout=seconds)
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            with contextlib.suppress(OSError):
                if connection.sock is not None:
                    connection.sock.shutdown(socket.SHUT_RDWR)

        assert self.workers is not None
        watchdog = self.workers.later(seconds, expire)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        try:
            connection.request("POST", target or "/", body=data, headers=headers)
            response = connection.getresponse()
            ok = 200 <= response.status < 300
            limit = self.max_response_bytes if ok else ERROR_BODY_BYTES
            declared = response.getheader("Content-Length")
            if ok and declared is not None and declared.isdigit() and int(declared) > limit:
                raise ServerError(
                    f"{url}: the answer is {int(declared):,} bytes, over max_response_bytes={limit:,}"
                )
            chunks, size = [], 0
            while size <= limit and (chunk := response.read(min(65536, limit + 1 - size))):
                chunks.append(chunk)
                size += len(chunk)
            if ok and size > limit:
                raise ServerError(f"{url}: the answer is over max_response_bytes={limit:,} bytes")
            if expired.is_set():
                raise TimeoutError(f"no complete answer within the {seconds:.1f}s left of the deadline")
            return response.status, response.getheader("Location"), b"".join(chunks)[:limit]
        except (OSError, http.client.HTTPException):
            if expired.is_set():
                raise TimeoutError(
                    f"no complete answer within the {seconds:.1f}s left of the deadline"
                ) from None
            raise
        finally:
            watchdog.cancel()
            connection.close()

    def _redact(self, text: str) -> str:
        return text.replace(self.api_key, "***") if self.api_key else text

    def _excerpt(self, body: bytes) -> str:
        text = " ".join(body[:2000].decode(errors="replace").split())
        text = self._redact(text)
        return repr(text[:200] + ("..." if len(text) > 200 else ""))

    def _json(self, url: str, body: bytes) -> dict[str, Any]:
        try:
            answer = json.loads(body)
        except ValueError:  # HTML error pages, truncated or binary bodies
            raise ServerError(f"{url}: the answer is not JSON: {self._excerpt(body)}") from None
        except RecursionError:  # Python's JSON reader recurses per level
            raise ServerError(
                f"{url}: the answer is JSON nested too deeply to read: {self._excerpt(body)}"
            ) from None
        if not isinstance(answer, dict):
            raise ServerError(
                f"{url}: the answer is a JSON {type(answer).__name__}, not an object: {self._excerpt(body)}"
            )
        return answer

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
        request = {"max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p}
        resample_cap = 10 * len(prompts) * group_size

        def sample(j: int) -> list[tuple[list[int], list[float], bool, str]]:
            prompt = prompt_ids[j] if self.send_token_ids else prompts[j]
            return self._sample_group(j, prompt, prompt_ids[j], group_size, request, base_seed, resample_cap)

        assert self.workers is not None
        pool = self.workers.pool(max(1, self.max_concurrency))
        futures = [pool.submit(functools.partial(sample, j)) for j in range(len(prompts))]
        per_prompt = [future.result() for future in futures]
        rollouts = Rollouts([], [], [], [], [])
        for j, samples in enumerate(per_prompt):
            for ids, logprobs, truncated, text in samples:
                rollouts.prompt_ids.append(prompt_ids[j])
                rollouts.completion_ids.append(ids)
                rollouts.sampler_logprobs.append(logprobs)
                rollouts.truncated.append(truncated)
                rollouts.completions.append(text)
        return rollouts

    def _sample_group(
        self,
        j: int,
        prompt: str | list[int],
        prompt_ids: list[int],
        group_size: int,
        request: dict[str, Any],
        base_seed: int,
        resample_cap: int,
    ) -> list[tuple[list[int], list[float], bool, str]]:
        """Prompt j's `group_size` samples (ids, log-probs, truncated, text), asking again for those that
        do not align (misaligned="resample", at most `resample_cap` over the call)."""
        out: list[tuple[list[int], list[float], bool, str]] = []
        attempt = 0
        while len(out) < group_size:
            payload = {
                **self.sampling,
                **request,
                "prompt": prompt,
                "n": group_size - len(out),
                "logprobs": 1,
                "seed": request_seed(base_seed, j, attempt),  # every request its own
                "stream": False,
            }
            if self.model is not None:
                payload["model"] = self.model
            response = self.post("/completions", payload)
            choices = self._choices(response)
            if not self.send_token_ids and len(choices) == 1:
                usage = response.get("usage")
                self._check_prompt(j, prompt_ids, usage if isinstance(usage, dict) else {})
            attempt += 1
            for choice in choices[: group_size - len(out)]:
                try:
                    out.append(self._align(j, choice))
                except AlignmentError:
                    if self.misaligned == "raise" or self.resampled >= resample_cap:
                        raise
                    self.resampled += 1
        return out

    def _choices(self, response: dict[str, Any]) -> list[dict[str, Any]]:
        """The response's choices in index order, each checked to have the shape `_align` reads."""
        url = self.base_url.rstrip("/") + "/completions"

        def malformed(what: str, value: Any) -> ServerError:
            excerpt = self._excerpt(json.dumps(value, default=str).encode())
            return ServerError(f"{url}: malformed completion answer: {what}: {excerpt}")

        choices = response.get("choices")
        if not isinstance(choices, list) or not choices:
            raise malformed("no list of choices", response)
        for choice in choices:
            if not isinstance(choice, dict) or not isinstance(choice.get("index", 0), int):
                raise malformed("a choice is not an object with an integer index", choice)
            if not isinstance(choice.get("text") or "", str):
                raise malformed("a choice's text is not a string", choice)
            logprobs = choice.get("logprobs")
            if logprobs is None:
                continue  # reported by _align
            if not isinstance(logprobs, dict) or not all(
                _list_of(logprobs.get(key), kind)
                for key, kind in (("tokens", str), ("token_logprobs", "number"), ("text_offset", int))
            ):
                raise malformed("a choice's logprobs are not lists of tokens, numbers and offsets", choice)
            tokens = logprobs.get("tokens")
            bad = [t for t in tokens or () if t.startswith("token_id:") and not t[9:].isdigit()]
            if bad:
                raise malformed(f"token {bad[0]!r} is no token id", choice)
        return sorted(choices, key=lambda c: c.get("index", 0))

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
            token = int(piece.removeprefix("token_id:"))
            if token >= self._vocabulary_size():
                raise ServerError(
                    f"{self.base_url.rstrip('/')}/completions: the server sampled token id {token}, outside the trainer's vocabulary "
                    f"of {self._vocabulary_size()}: it serves another model; serve the trainer's"
                )
            return token
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

    def _held_back(self, ids: list[int]) -> str:
        """The text of `ids` as an incremental detokenizer ends it (vLLM's, tokenizers' DecodeStream): the
        tokens of a character the completion cut short decode to U+FFFD here, so it holds them back, from
        the first token after which the text ends in U+FFFD; that token may carry whole characters too (a
        byte-level " " plus the first byte of "é")."""
        m = len(ids)
        while m and self.tokenizer.decode(ids[:m]).endswith("\ufffd"):
            m -= 1
        return self.tokenizer.decode(ids[:m])

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
        lps = [math.nan if v is None else self._logprob(j, k, float(v)) for k, v in enumerate(values)]
        eos = self.tokenizer.eos_token_id
        # the text excludes a final EOS however the server lists it
        body = ids[:-1] if ids and ids[-1] == eos else ids
        decoded = self.tokenizer.decode(body)
        # servers may leave special tokens out of the text (vLLM and gspo serve skip them by default)
        plain = self.tokenizer.decode(body, skip_special_tokens=True)
        if text not in (decoded, plain) and text != self._held_back(body):
            raise AlignmentError(
                f"prompt {j}: the server's tokens decode to {decoded!r} with the trainer's "
                f"tokenizer but its completion text is {text!r}: the two tokenizers differ"
            )
        finish = choice.get("finish_reason")
        if finish == "stop" and (not ids or ids[-1] != eos):
            ids, lps = [*ids, eos], [*lps, math.nan]  # the engine stopped on EOS without listing it
        return ids, lps, finish != "stop", text

    def _logprob(self, j: int, k: int, value: float) -> float:
        """A reported log-probability, checked (gspo.rollout.samplers.logprob_problem); a rounding above 0
        taken as 0."""
        why = logprob_problem(value)
        if why is not None:
            raise ServerError(
                f"{self.base_url.rstrip('/')}/completions: prompt {j}, completion token {k}: the server reported "
                f"the log-probability {value!r}, {why}"
            )
        return min(value, 0.0)

    def _vocabulary_size(self) -> int:
        if self._vocabulary is None:
            self._vocabulary = len(self.tokenizer)
        return self._vocabulary

    # ---- weights ------------------------------------------------------------------------------------
    def sync_weights(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, step: int) -> None:
        """Hand the trainer's current weights to the server (no-op without a `weight_sync`)."""
        if self.weight_sync is not None:
            self.weight_sync(model, tokenizer, step)


def _list_of(value: Any, kind: type | str) -> bool:
    """None, or a list of `kind` (a "number" is a real or None: servers send null for unknown log-probs)."""
    if value is None:
        return True
    if kind == "number":
        return isinstance(value, list) and all(
            v is None or (isinstance(v, numbers.Real) and not isinstance(v, bool)) for v in value
        )
    return isinstance(value, list) and all(isinstance(v, kind) and not isinstance(v, bool) for v in value)
