"""What the sampling engine (gspo.rollout.hf_engine) is asked for and what it answers: a request's
`SamplingParams`, its samples' records (`Completion`: exact token ids and log-probs) and the per-step
`Event`s a driver streams."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class SamplingParams:
    """How the samples of a request are drawn and when they stop."""

    max_new_tokens: int
    """Completion length limit (tokens)."""
    temperature: float = 1.0
    """Sampling temperature (> 0); log-probs are those of log_softmax(logits / temperature)."""
    top_p: float = 1.0
    """Nucleus threshold (1.0: off); not folded into the log-probs."""
    greedy: bool = False
    """Take the most likely token (log-probs then at temperature 1)."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end a sample besides the engine's own (EOS); the stop token is kept in the completion."""
    seed: int | None = None
    """The request's random streams: sample i draws from stream (seed, i); None: a fresh seed."""
    top_logprobs: int = 0
    """Log-probs of this many most likely tokens per generated token (0 to 20)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: generate at least one token")
        if not self.greedy and not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature}: use a positive value, or greedy=True")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: choose a value in (0, 1]")
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs={self.top_logprobs}: choose 0 to 20")


@dataclass(eq=False)
class Completion:
    """One sample of a request: its exact prompt and completion token ids and per-token log-probs."""

    request: Request
    index: int
    """Its index among the request's n samples (its random stream)."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    """Per generated token (when the request asked for them): (token id, log-prob), most likely first."""
    finish_reason: str | None = None
    """None while generating; "stop" (a stop token, kept), "length" or "cancelled"."""

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_ids


@dataclass(eq=False)
class Request:
    """A prompt and its n samples (`samples`, in order)."""

    id: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    samples: list[Completion] = field(default_factory=list)

    @property
    def prompt_key(self) -> tuple[int, ...]:
        return tuple(self.prompt_ids)

    @property
    def done(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


@dataclass(frozen=True)
class Event:
    """What one step did for one sample: the token it drew and, if it ended, why (a cancellation has
    token -1 and log-prob 0)."""

    sample: Completion
    token: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None
    finish_reason: str | None


class StepEngine(Protocol):
    """What a streaming engine answers to (gspo's own, gspo.rollout.hf_engine.Engine, or vLLM's,
    gspo.rollout.vllm_engine.VLLMEngine): work arrives as requests at any time, and each `step` draws one token
    per running sample; the driver thread of gspo.sampling.driver is its only caller of `step`."""

    slots: int
    max_length: int

    @property
    def idle(self) -> bool: ...

    def submit(self, prompt_ids: Sequence[int], n: int, params: SamplingParams) -> Request: ...

    def cancel(self, request: Request) -> None: ...

    def step(self) -> list[Event]: ...

    def release(self) -> None: ...

    def reset_prefix_cache(self) -> None: ...
