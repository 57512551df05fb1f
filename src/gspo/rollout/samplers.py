"""Samplers: G completions per prompt with the sampler's per-token log-probs, from any engine.

A `Sampler` is the trainer's own model in this process (`HFSampler`, over gspo.rollout.engine's
continuous-batching engine, which computes each prompt once for its G samples) or an OpenAI-compatible
server (gspo.rollout.openai.OpenAIBackend). The log-probs are those of the tempered distribution,
log_softmax(logits / temperature) at the sampled token, which the trainer also scores; top-p truncation
is not folded into them (as in vLLM's default), and there is no implicit top-k.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gspo.rollout.engine import Engine
from gspo.rollout.requests import SamplingParams


@dataclass
class Rollouts:
    """Completions of a rollout batch, sample-major: the G samples of prompt j are rows j*G .. j*G+G-1."""

    prompt_ids: list[list[int]]
    """Token ids of each sample's (templated) prompt."""
    completion_ids: list[list[int]]
    """Sampled token ids, up to and including the first EOS."""
    sampler_logprobs: list[list[float]]
    """log pi_sampler of each completion token (aligned with completion_ids)."""
    truncated: list[bool]
    """True when the completion hit max_new_tokens without an EOS."""
    completions: list[str]
    """Decoded completions, special tokens removed."""
    computed_tokens: int = 0
    """Tokens the sampler ran through the model (prompts once per group, padding included); 0: unknown."""

    def __len__(self) -> int:
        return len(self.completion_ids)


def tokenize_prompts(tokenizer: PreTrainedTokenizerBase, prompts: list[str]) -> list[list[int]]:
    # a chat template already wrote the special tokens it needs; a raw prompt gets the tokenizer's (e.g. BOS)
    add_special = getattr(tokenizer, "chat_template", None) is None
    return [tokenizer(p, add_special_tokens=add_special).input_ids for p in prompts]


def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    params: SamplingParams,
    *,
    group_size: int = 1,
    batch_size: int = 64,
) -> Rollouts:
    """Sample `group_size` completions of each prompt (already templated), `batch_size` at a time, with
    a sampling engine of its own (gspo.rollout.engine: each prompt computed once for its G samples, slots
    refilled as samples end). params.seed: the random streams (None: drawn from torch's global
    generator)."""
    engine = Engine(model, slots=batch_size, stop_token_ids=[_eos_id(tokenizer)])
    return engine_rollouts(engine, tokenizer, prompts, group_size, params)


def engine_rollouts(
    engine: Engine,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    group_size: int,
    params: SamplingParams,
) -> Rollouts:
    """`group_size` samples of each prompt from `engine`, run to completion, as sample-major Rollouts."""
    computed = engine.computed_tokens
    requests = engine.generate(tokenize_prompts(tokenizer, prompts), group_size, params)
    out = Rollouts([], [], [], [], [], computed_tokens=engine.computed_tokens - computed)
    for request in requests:
        for sample in request.samples:
            out.prompt_ids.append(request.prompt_ids)
            out.completion_ids.append(sample.token_ids)
            out.sampler_logprobs.append(sample.logprobs)
            out.truncated.append(sample.finish_reason == "length")
            out.completions.append(tokenizer.decode(sample.token_ids, skip_special_tokens=True))
    return out


def _eos_id(tokenizer: PreTrainedTokenizerBase) -> int:
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token: set tokenizer.eos_token so completions can stop")
    return tokenizer.eos_token_id


class Sampler(Protocol):
    """Draws ``group_size`` completions of each (templated) prompt, with their per-token log-probs.

    current: whether the samples come from the trainer's current weights in its compute dtype, so that
    its log-probs are the old policy's (``train.old_logprobs=auto`` then skips the recompute pass).
    sync_weights: called after each rollout batch's updates, to hand the new weights to the engine.
    """

    current: bool

    def generate(
        self,
        prompts: list[str],
        *,
        group_size: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> Rollouts: ...

    def sync_weights(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, step: int) -> None: ...


@dataclass
class HFSampler:
    """The trainer's own model, sampling in this process through one gspo.rollout.engine.Engine of
    `batch_size` slots (each prompt computed once per group, slots refilled as samples end).

    context: entered around each call, e.g. FSDP2's gathered parameters and the compute dtype's autocast.
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    batch_size: int = 64
    context: Callable[[], AbstractContextManager[Any]] = field(default=contextlib.nullcontext)
    current: bool = True
    engine: Engine = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.engine = Engine(
            self.model,
            slots=self.batch_size,
            stop_token_ids=[_eos_id(self.tokenizer)],
            context=self.context,
        )

    def generate(
        self,
        prompts: list[str],
        *,
        group_size: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        greedy: bool = False,
        seed: int | None = None,
    ) -> Rollouts:
        """seed: the random streams of this call (None: drawn from torch's global generator, so a seeded
        run, and its resumption from a checkpoint, draws the same)."""
        params = SamplingParams(
            max_new_tokens, temperature=temperature, top_p=top_p, greedy=greedy, seed=seed
        )
        return engine_rollouts(self.engine, self.tokenizer, prompts, group_size, params)

    def sync_weights(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, step: int) -> None:
        """Nothing to copy: it samples from the trainer's own parameters (the engine keeps no prompt
        computed with the old ones: it is idle between calls)."""
