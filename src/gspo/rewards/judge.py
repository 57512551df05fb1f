"""An LLM judge as a reward function: each group's completions scored against each other by a model behind an
OpenAI-compatible endpoint (`gspo serve`, vLLM, a llama.cpp server, a hosted API), in the form of ART's
RULER: one chat completion per group, whose answer gives every completion a score in [0, 1].

The request is one user message, the template file of ``judge.template`` with ``$prompt`` (the example's own
prompt: its text, or a conversation as "role: content" lines; not the chat template's markup), ``$completions`` (the group's completions, numbered from 1, each after a ``---`` line), ``$n``
(how many) and any field of the group's example (``$answer``: a reference for the judge) substituted
(Python's string.Template: a ``$`` of your own is ``$$``, braces are free for a JSON example). The answer must hold a JSON object with ``"scores"``: n numbers in [0, 1], in the completions'
order (its last such object is read, so the judge may reason first). A group is what gspo drew as one: the
completions of one group id (``group_ids``: gspo.rewards.scoring), so two groups of one prompt side by side
are judged apart. Groups are judged concurrently, at most ``reward_concurrency`` at a time,
each call within ``reward_timeout``; an answer that is not so, or a server error, stops the run with one line
(exit code 7). Relative scores are what group-relative advantages need: the judge ranks, the advantage
centres.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import string
from pathlib import Path
from typing import Any

from gspo.rewards.calling import KEYWORDS, RewardError

_OBJECT = re.compile(r"\{[^{}]*\}")


def groups_of(group_ids: list[int]) -> list[list[int]]:
    """The completions of each group, by index, in the order the groups first appear."""
    groups: dict[int, list[int]] = {}
    for i, group in enumerate(group_ids):
        groups.setdefault(group, []).append(i)
    return list(groups.values())


def parse_scores(answer: str, n: int) -> list[float]:
    """The ``"scores"`` of the last JSON object in ``answer`` that has them: n numbers in [0, 1]."""
    for text in reversed(_OBJECT.findall(answer)):
        try:
            found = json.loads(text)
        except json.JSONDecodeError:
            continue
        if isinstance(found, dict) and "scores" in found:
            scores = found["scores"]
            if not isinstance(scores, list) or len(scores) != n:
                raise ValueError(f'"scores" holds {scores!r}, not {n} numbers')
            if not all(
                isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) and 0 <= s <= 1
                for s in scores
            ):
                raise ValueError(f'"scores" {scores!r} are not numbers in [0, 1]')
            return [float(s) for s in scores]
    raise ValueError('no JSON object with "scores" in the answer')


RESPONSE_FORMATS = ("json_schema", "json_object", "none")
"""How a request asks for the answer's form (``judge.response_format``)."""

OWN = {"prompt", "completions", "n"}
"""The template's identifiers the judge fills itself; any other names a field of the examples."""


def scores_schema(n: int) -> dict[str, Any]:
    """The answer's JSON schema: an object whose "scores" are n numbers in [0, 1]."""
    scores = {
        "type": "array",
        "items": {"type": "number", "minimum": 0, "maximum": 1},
        "minItems": n,
        "maxItems": n,
    }
    schema = {
        "type": "object",
        "properties": {"scores": scores},
        "required": ["scores"],
        "additionalProperties": False,
    }
    return schema


def response_format(kind: str, n: int) -> dict[str, Any] | None:
    """The request's response_format of ``kind`` (RESPONSE_FORMATS) for n completions: OpenAI's structured
    outputs, JSON mode with the schema beside it as llama-cpp-python's server takes it, or none."""
    if kind == "json_schema":
        return {
            "type": "json_schema",
            "json_schema": {"name": "scores", "schema": scores_schema(n), "strict": True},
        }
    if kind == "json_object":
        return {"type": "json_object", "schema": scores_schema(n)}
    return None


class Judge:
    """The judge of ``url`` (an API root, e.g. "http://127.0.0.1:8000/v1"), asking ``model`` with the prompt
    template ``template`` (module docstring); an ``async`` batch reward function."""

    def __init__(
        self,
        url: str,
        template: str | Path,
        *,
        model: str | None = None,
        api_key: str | None = None,
        max_tokens: int = 512,
        temperature: float = 0.0,
        response_format: str = "json_schema",
        concurrency: int = 8,
    ) -> None:
        path = Path(template)
        if not path.is_file():
            raise FileNotFoundError(f"judge.template: {path} is not a file: give the judge's prompt template")
        self.template = string.Template(path.read_text(encoding="utf-8"))
        missing = {"prompt", "completions"} - set(self.template.get_identifiers())
        if missing:
            raise ValueError(
                f"judge.template: {path} names no ${' nor $'.join(sorted(missing))}: the judge must see the "
                "prompt and the group's completions"
            )
        self.url, self.model, self.api_key = url, model, api_key
        self.max_tokens, self.temperature, self.concurrency = max_tokens, temperature, concurrency
        if response_format not in RESPONSE_FORMATS:
            raise ValueError(f"judge.response_format: {response_format!r} is none of {RESPONSE_FORMATS}")
        self.response_format = response_format
        self.fields = sorted(set(self.template.get_identifiers()) - OWN)
        self.__name__ = "judge"
        self._client: Any = None
        self._client_loop: Any = None
        self._served: str | None = None

    def request(
        self, prompt: str, completions: list[str], fields: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The chat completion request that judges one group; ``fields``: its example's, by name."""
        numbered = "\n".join(f"--- {k}\n{c}" for k, c in enumerate(completions, start=1))
        message = self.template.safe_substitute(
            fields or {}, prompt=prompt, completions=numbered, n=len(completions)
        )
        body: dict[str, Any] = {
            "messages": [{"role": "user", "content": message}],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
        }
        if self.model is not None:
            body["model"] = self.model
        form = response_format(self.response_format, len(completions))
        if form is not None:
            body["response_format"] = form
        return body

    async def __call__(
        self,
        prompts: list[str],
        completions: list[str],
        *,
        group_ids: list[int],
        example_prompts: list[Any] | None = None,
        **fields: Any,
    ) -> list[float]:
        fields = {name: values for name, values in fields.items() if name not in KEYWORDS}  # the examples'
        missing = [name for name in self.fields if name not in fields]
        if missing:
            raise RewardError(
                f"judge.template names ${', $'.join(missing)}, which the examples do not have: it may name "
                f"$prompt, $completions, $n and the examples' fields ({', '.join(sorted(fields)) or 'none'})"
            )
        limit = asyncio.Semaphore(self.concurrency)
        groups = groups_of(group_ids)

        questions = [as_text(p) for p in example_prompts] if example_prompts is not None else prompts

        async def judged(group: list[int]) -> list[float]:
            own = {name: fields[name][group[0]] for name in self.fields}
            async with limit:
                return await self._judge(questions[group[0]], [completions[i] for i in group], own)

        scores = [0.0] * len(completions)
        for group, judged_scores in zip(
            groups, await asyncio.gather(*(judged(g) for g in groups)), strict=True
        ):
            for i, value in zip(group, judged_scores, strict=True):
                scores[i] = value
        return scores

    async def _judge(self, prompt: str, completions: list[str], fields: dict[str, Any]) -> list[float]:
        body = self.request(prompt, completions, fields)
        if "model" not in body:
            body["model"] = await self._served_model()
        answer = await self._post(body)
        try:
            return parse_scores(answer, len(completions))
        except ValueError as error:
            raise RewardError(
                f"the judge at {self.url} answered without usable scores ({error}): {answer[:200]!r}; make its "
                f'template ask for a JSON object {{"scores": [...]}} of {len(completions)} numbers in [0, 1]'
            ) from None

    async def _post(self, body: dict[str, Any]) -> str:
        """The judge's answer text to one chat completion request: POSTed to url/chat/completions, redirects
        refused (the prompts and the key stay with the server named), transient failures (a connection
        refused, HTTP 429 or 5xx) tried again `RETRIES` times; any other answer, or one that is not a chat
        completion's JSON, is a RewardError naming the URL and what was wrong."""
        import httpx

        client = self._http()
        endpoint = self.url.rstrip("/") + "/chat/completions"
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        last = ""
        for attempt in range(RETRIES + 1):
            if attempt:
                await asyncio.sleep(0.5 * 2 ** (attempt - 1))
            try:
                async with client.stream("POST", endpoint, json=body, headers=headers) as response:
                    status = response.status_code
                    if 300 <= status < 400:
                        where = response.headers.get("location", "another address")
                        raise RewardError(
                            f"the judge at {self.url} answered with a redirect (HTTP {status} to {where}): gspo "
                            "does not follow redirects (the prompts, completions and key would go along): set "
                            "judge.url to the address that answers"
                        )
                    data = await _read(response, ANSWER_BYTES)
            except httpx.HTTPError as error:  # refused, reset, timed out
                last = f"{type(error).__name__}: {error}"
                continue
            if status == 429 or status >= 500:
                last = f"HTTP {status}: {_excerpt(data)}"
                continue
            if status >= 400 and self.response_format != "none" and b"response_format" in (data or b""):
                raise RewardError(
                    f"the judge at {self.url} refuses the request's response_format ({self.response_format}): "
                    f"HTTP {status}: {_excerpt(data)}; set judge.response_format=none (gspo serve), or "
                    "json_object (llama-cpp-python's server)"
                )
            if status >= 400:
                raise RewardError(f"the judge at {self.url} failed: HTTP {status}: {_excerpt(data)}")
            return self._content(data)
        raise RewardError(f"the judge at {self.url} failed after {RETRIES + 1} attempts: {last}")

    def _content(self, data: bytes | None) -> str:
        """The message content of a chat completion's JSON body, or a RewardError saying what it is instead."""
        if data is None:
            raise RewardError(
                f"the judge at {self.url} answered more than {ANSWER_BYTES:,} bytes: not a chat completion"
            )
        try:
            answer = json.loads(data)
        except (ValueError, RecursionError):
            raise RewardError(
                f"the judge at {self.url} answered something that is not JSON: {_excerpt(data)}"
            ) from None
        try:
            content = answer["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            shape = type(answer).__name__ if not isinstance(answer, dict) else f"keys {sorted(answer)[:8]}"
            raise RewardError(
                f"the judge at {self.url} answered JSON that is not a chat completion (a {shape}, no "
                f"choices[0].message.content): {_excerpt(data)}"
            ) from None
        if content is not None and not isinstance(content, str):
            raise RewardError(
                f"the judge at {self.url} answered a message whose content is a {type(content).__name__}, "
                f"not text: {_excerpt(data)}"
            )
        return content or ""

    async def _served_model(self) -> str:
        """judge.model, or (None) the model the server serves: the first of its /models (so a server of one
        model, gspo serve's "gspo" or vLLM's, needs no name), else "judge"."""
        if self.model is not None:
            return self.model
        if self._served is None:
            self._served = "judge"
            with contextlib.suppress(Exception):  # a server without /models: the request names "judge"
                response = await self._http().get(self.url.rstrip("/") + "/models", timeout=10.0)
                listed = response.json().get("data") or []
                if response.status_code == 200 and listed and isinstance(listed[0].get("id"), str):
                    self._served = listed[0]["id"]
        return self._served

    def _http(self) -> Any:
        """An HTTP client of the loop this call runs on (a client is bound to the loop that made it)."""
        import httpx

        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            self._client = httpx.AsyncClient(
                follow_redirects=False, timeout=httpx.Timeout(300.0), trust_env=False
            )
            self._client_loop = loop
        return self._client


def as_text(prompt: Any) -> str:
    """An example's prompt as the judge reads it: the text itself, or a conversation's messages as
    "role: content" lines (never the chat template's markup)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return "\n".join(
            f"{m.get('role', '')}: {m.get('content', '')}" for m in prompt if isinstance(m, dict)
        )
    return str(prompt)


RETRIES = 2
"""Attempts after the first for a transient failure (a connection refused, HTTP 429 or 5xx)."""

ANSWER_BYTES = 4 * 2**20
"""The longest answer read: a chat completion of judge.max_tokens is far shorter."""


async def _read(response: Any, limit: int) -> bytes | None:
    """The response's body, or None once it passes ``limit`` bytes."""
    chunks, size = [], 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _excerpt(data: bytes | None) -> str:
    text = " ".join((data or b"")[:400].decode(errors="replace").split())
    return repr(text[:200] + ("..." if len(text) > 200 else ""))
