"""An LLM judge as a reward function: each group's completions scored against each other by a model behind an
OpenAI-compatible endpoint (`gspo serve`, vLLM, a llama.cpp server, a hosted API), in the form of ART's
RULER: one chat completion per group, whose answer gives every completion a score in [0, 1].

The request is one user message, the template file of ``judge.template`` with ``$prompt`` (the prompt as the
policy saw it), ``$completions`` (the group's completions, numbered from 1, each after a ``---`` line), ``$n``
(how many) and any field of the group's example (``$answer``: a reference for the judge) substituted
(Python's string.Template: a ``$`` of your own is ``$$``, braces are free for a JSON example). The answer must hold a JSON object with ``"scores"``: n numbers in [0, 1], in the completions'
order (its last such object is read, so the judge may reason first). A group is a run of completions with
the same prompt, as gspo draws them. Groups are judged concurrently, at most ``reward_concurrency`` at a time,
each call within ``reward_timeout``; an answer that is not so, or a server error, stops the run with one line
(exit code 7). Relative scores are what group-relative advantages need: the judge ranks, the advantage
centres.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import string
from pathlib import Path
from typing import Any

from gspo.rewards.calling import RewardError

_OBJECT = re.compile(r"\{[^{}]*\}")


def groups_of(prompts: list[str]) -> list[range]:
    """The runs of consecutive equal prompts: the groups of a batch, as gspo draws them."""
    runs: list[range] = []
    start = 0
    for i in range(1, len(prompts) + 1):
        if i == len(prompts) or prompts[i] != prompts[start]:
            runs.append(range(start, i))
            start = i
    return runs


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

    async def __call__(self, prompts: list[str], completions: list[str], **fields: Any) -> list[float]:
        missing = [name for name in self.fields if name not in fields]
        if missing:
            raise RewardError(
                f"judge.template names ${', $'.join(missing)}, which the examples do not have: it may name "
                f"$prompt, $completions, $n and the examples' fields ({', '.join(sorted(fields)) or 'none'})"
            )
        limit = asyncio.Semaphore(self.concurrency)
        groups = groups_of(prompts)

        async def judged(group: range) -> list[float]:
            own = {name: fields[name][group.start] for name in self.fields}
            async with limit:
                return await self._judge(prompts[group.start], [completions[i] for i in group], own)

        scores = await asyncio.gather(*(judged(group) for group in groups))
        return [s for group in scores for s in group]

    async def _judge(self, prompt: str, completions: list[str], fields: dict[str, Any]) -> list[float]:
        import openai

        if self._client is None:  # made on the loop that awaits it (the run's)
            self._client = openai.AsyncOpenAI(
                base_url=self.url, api_key=self.api_key or "none", max_retries=2
            )
        body = self.request(prompt, completions, fields)
        try:
            response = await self._client.chat.completions.create(model=body.pop("model", "judge"), **body)
        except openai.OpenAIError as error:
            raise RewardError(f"the judge at {self.url} failed: {type(error).__name__}: {error}") from None
        answer = response.choices[0].message.content or ""
        try:
            return parse_scores(answer, len(completions))
        except ValueError as error:
            raise RewardError(
                f"the judge at {self.url} answered without usable scores ({error}): {answer[:200]!r}; make its "
                f'template ask for a JSON object {{"scores": [...]}} of {len(completions)} numbers in [0, 1]'
            ) from None
