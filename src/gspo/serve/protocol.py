"""The requests the server accepts, as pydantic models, and its errors in OpenAI's JSON shape.

Fields follow OpenAI's API; an unknown field is refused (naming it) rather than ignored, and fields that
would change the sampled distribution in ways the trainer does not score (penalties, logit bias, JSON mode)
are refused unless they are at their neutral value. Fields clients send that change nothing here (user,
metadata, store, ...) are accepted. gspo's own fields: a message's ``completion_id`` (the record whose
tokens an assistant message is), and the train request.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from gspo.rollout.data import surrogate_problem


class ServeError(Exception):
    """A request the server refuses: HTTP `status`, a one-line message, the field it is about (`param`)."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    # strict: a JSON boolean is not a number (max_tokens: true was taken as 1), nor a number a boolean
    model_config = ConfigDict(extra="forbid", strict=True)


FLOAT32_MAX = 3.4028234663852886e38
"""The largest float32: rewards and advantages are computed in float32, as `gspo train`'s."""


def _fits_float32(value: float) -> float:
    if abs(value) > FLOAT32_MAX:
        raise ValueError(
            f"{value:g} is beyond float32's range (about 3.4e38), in which the trainer computes: send a "
            "smaller value"
        )
    return value


TrainFloat = Annotated[float, Field(allow_inf_nan=False), AfterValidator(_fits_float32)]
"""A reward or advantage: finite and within float32's range."""


class StreamOptions(_Strict):
    include_usage: bool = False


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


def _text(value: Any) -> Any:
    """`value` (a text, or texts inside lists and mappings), refused when it holds no text: a lone surrogate
    (gspo.rollout.data.surrogate_problem), which the tokenizer failed on with an internal type message."""
    if isinstance(value, str) and (problem := surrogate_problem(value)):
        raise ValueError(problem)
    for item in value.values() if isinstance(value, dict) else value if isinstance(value, list) else ():
        _text(item)
    return value


def _unscored(what: str) -> Callable[[Any], Any]:
    """A field that would sample from another distribution than the policy's, which the trainer scores:
    only its neutral value (0, {}) is taken, and a refusal says so, not a range."""

    def check(value: Any) -> Any:
        if value:
            raise ValueError(
                f"{what} changes the distribution the trainer scores, so gspo serve samples without one: "
                "leave it out (or send 0)"
            )
        return value

    return check


def _plain_text(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """response_format: text only; JSON mode and schemas constrain the sampling (as `_unscored`)."""
    if value is not None and value != {"type": "text"}:
        raise ValueError(
            "JSON mode and schemas constrain the sampling, which changes the distribution the trainer scores: "
            "leave response_format out (or send {'type': 'text'})"
        )
    return value


def _tool_choice(value: Any) -> Any:
    """tool_choice: "none" or "auto"; forcing a call ("required", a named function) constrains the sampling
    (as `_unscored`), so it is refused with the reason and what to do instead."""
    if value is None or value in ("none", "auto"):
        return value
    forced = value if isinstance(value, str) else "a named function"
    raise ValueError(
        f"tool_choice={forced!r} forces a tool call, which constrains the sampling and changes the distribution "
        "the trainer scores: send tool_choice='auto' (the model calls a tool when the template and its training "
        "lead it to; reward the calls you want), or leave tool_choice out"
    )


class Message(BaseModel):
    """A chat message; keys beyond these are passed to the chat template (templates may read them)."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[dict[str, Any]] | None, AfterValidator(_text)] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    completion_id: str | None = None
    """gspo: the completion this assistant message is (its recorded tokens are used, not a re-tokenisation)."""


class SamplingFields(_Strict):
    """What chat and text completions share."""

    model: str
    n: int = Field(1, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: Annotated[float | None, AfterValidator(_unscored("a frequency penalty"))] = None
    """Refused unless 0 (or absent): penalties change the distribution the trainer scores."""
    presence_penalty: Annotated[float | None, AfterValidator(_unscored("a presence penalty"))] = None
    logit_bias: Annotated[dict[str, float] | None, AfterValidator(_unscored("a logit bias"))] = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None


class ChatRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Annotated[Any, AfterValidator(_tool_choice)] = None
    parallel_tool_calls: bool | None = None
    response_format: Annotated[dict[str, Any] | None, AfterValidator(_plain_text)] = None


def prompt_shape(value: Any) -> str | list[str] | list[int] | list[list[int]]:
    """/v1/completions' prompt: a text, texts, token ids or lists of token ids, checked with an early exit.
    (pydantic's union would try list[str] on a list of ids and build one error per id: 330 MB for a 4 MB
    body.) Booleans are not token ids."""

    def ids(items: Any) -> bool:
        return isinstance(items, list) and all(type(t) is int for t in items)

    if isinstance(value, str) or (
        isinstance(value, list)
        and (all(isinstance(p, str) for p in value) or ids(value) or all(ids(p) for p in value))
    ):
        return value
    raise ValueError("give a text, a list of texts, token ids or lists of token ids")


class CompletionRequest(SamplingFields):
    prompt: Annotated[Any, AfterValidator(prompt_shape), AfterValidator(_text)]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: Literal[False] = False
    suffix: None = None
    best_of: int | None = Field(None, ge=1)


class TrajectoryIn(_Strict):
    """One episode: the completions of its turns, in order, and its reward."""

    completion_ids: list[str] = Field(min_length=1)
    reward: TrainFloat
    turn_rewards: list[TrainFloat] | None = Field(None, min_length=1)
    """One per turn (completion), for per-turn advantages (reward-to-go: docs/trajectories.md)."""
    advantages: list[list[TrainFloat]] | None = Field(None, min_length=1)
    """Per turn, one advantage per completion token: used as given (no group normalisation)."""


class GroupIn(_Strict):
    trajectories: list[TrajectoryIn] = Field(min_length=1)


class TrainRequest(_Strict):
    model: str | None = None
    groups: list[GroupIn] = Field(min_length=1)
    request_id: str | None = Field(None, min_length=1, max_length=200)
    """An idempotency key: a train call repeating the id of one already applied returns its answer again
    instead of training twice (a client retrying after a lost answer)."""


_TYPE_TAG = re.compile(r"(str|int|float|bool|none|[a-z-]+\[.*\])")
"""How pydantic names the member of a union in an error's location ("str", "list[int]", ...)."""


def field_name(location: tuple[Any, ...]) -> str:
    """pydantic's error location as a field name: ("body", "messages", 0, "role") -> "messages[0].role"."""
    parts: list[str] = []
    for item in location:
        if item == "body" and not parts:
            continue
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif isinstance(item, str) and not _TYPE_TAG.fullmatch(item):
            parts.append(("." if parts else "") + item)
    return "".join(parts)
