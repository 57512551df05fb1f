"""Samplers: G completions per prompt with the sampler's per-token log-probs, from any engine.

A `Sampler` is the trainer's own model in this process (`HFSampler`, over gspo.rollout.hf_engine's
continuous-batching engine, which computes each prompt once for its G samples) or an OpenAI-compatible
server (gspo.rollout.openai.OpenAIBackend). The log-probs are those of the tempered distribution,
log_softmax(logits / temperature) at the sampled token, which the trainer also scores; top-p truncation
is not folded into them (as in vLLM's default), and there is no implicit top-k.

A sampler of the user's own (rollout.engine=file.py:function) is wrapped in `CheckedSampler`: its rollouts
are checked as a server's answer is (`check_rollouts`), and what it returns or raises that no model could
give is a `ServerError` line, never a traceback or a row trained silently.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gspo.rollout.hf_engine import Engine
from gspo.rollout.requests import SamplingParams
from gspo.rollout.user_code import raised, raised_where

LOGPROB_ROUNDING = 1e-3
"""A reported log-probability up to this far above 0 is a certain token's rounding (fp16 log-softmax), taken
as 0; beyond it, or not finite, it is no log-probability and the rollouts are refused."""


class ServerError(RuntimeError):
    """The inference server, or a sampler of the user's, gave no usable rollouts: down, overloaded, timed
    out, refused the request, raised, or answered what no model could (gspo's exit code 8)."""


def logprob_problem(value: object) -> str | None:
    """Why `value` is no log-probability a sampler may report, or None: one is a real number, finite and
    <= 0 (up to `LOGPROB_ROUNDING`)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return f"which is a {type(value).__name__}, not a number"
    if not (math.isfinite(value) and value <= LOGPROB_ROUNDING):
        return "which no probability has (log-probabilities are finite and <= 0)"
    return None


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
    a sampling engine of its own (gspo.rollout.hf_engine: each prompt computed once for its G samples, slots
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
    """The trainer's own model, sampling in this process through one gspo.rollout.hf_engine.Engine of
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

    def step_engine(self, *, slots: int, stop_token_ids: Sequence[int]) -> Engine:
        """A streaming engine over the same model, for `gspo serve`: ``slots`` samples decoded at once, each
        ending at any of ``stop_token_ids`` (gspo.rollout.requests.StepEngine)."""
        return Engine(self.model, slots=slots, stop_token_ids=list(stop_token_ids), context=self.context)

    def sync_weights(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, step: int) -> None:
        """Nothing to copy: it samples from the trainer's own parameters (the engine keeps no prompt
        computed with the old ones: it is idle between calls)."""


ROWS = ("prompt_ids", "completion_ids", "sampler_logprobs", "truncated", "completions")
"""The fields of `Rollouts` that hold one row per sample."""


def _ids_problem(ids: object, vocabulary: int) -> str | None:
    """Why `ids` is no list of token ids of a vocabulary of `vocabulary`, or None (with the token's place)."""
    if not isinstance(ids, (list, tuple)):
        return f" is a {type(ids).__name__}, not a list of token ids"
    for k, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            return f"[{k}] is {token!r}, not a token id (an integer)"
        if not 0 <= token < vocabulary:
            return (
                f"[{k}] = {token}, outside the trainer's vocabulary of {vocabulary} (ids 0..{vocabulary - 1})"
            )
    return None


def _logprobs(values: object, ids: list[int], eos: int | None) -> tuple[list[float], str | None]:
    """(the log-probs of one completion, unknown ones as NaN; why they are refused, or None). Aligned with
    `ids`, one per token; each finite and <= 0 (a rounding above 0 taken as 0), or unknown: None (a
    server's null), or NaN on a final EOS (where the built-in engines mark one the server did not list)."""
    if not isinstance(values, (list, tuple)):
        return [], f" is a {type(values).__name__}, not a list of log-probabilities"
    if len(values) != len(ids):
        return (
            [],
            f" has {len(values)} values for the {len(ids)} tokens of its completion_ids row (one per token)",
        )
    out = []
    for k, value in enumerate(values):
        final_eos = k == len(ids) - 1 and ids[k] == eos and isinstance(value, float) and math.isnan(value)
        if value is None or final_eos:
            out.append(math.nan)  # unknown: the trainer computes it
            continue
        why = logprob_problem(value)
        if why is not None:
            return (
                [],
                f"[{k}] = {value!r}, {why}; None marks a token whose log-probability the sampler does not know",
            )
        out.append(min(float(value), 0.0))
    return out, None


def check_rollouts(
    rollouts: object, *, samples: int, max_new_tokens: int, vocabulary: int, eos: int | None
) -> Rollouts:
    """`rollouts` from a sampler that is not gspo's own, checked as a server's answer is
    (gspo.rollout.openai): `Rollouts` with one row per sample in every field (`samples` rows, sample-major),
    each row checked by `_checked_row`. Returns the rows normalised; raises ValueError naming the field, the
    row and the token."""
    if not isinstance(rollouts, Rollouts):
        raise ValueError(f"a {type(rollouts).__name__}, not gspo.rollout.samplers.Rollouts")
    for name in ROWS:
        rows = getattr(rollouts, name)
        if not isinstance(rows, (list, tuple)) or len(rows) != samples:
            what = f"{len(rows)} rows" if isinstance(rows, (list, tuple)) else f"a {type(rows).__name__}"
            raise ValueError(f"{name} has {what} for {samples} samples (one row per sample)")
    computed = rollouts.computed_tokens
    if isinstance(computed, bool) or not isinstance(computed, numbers.Integral) or computed < 0:
        raise ValueError(f"computed_tokens = {computed!r}, not a count of tokens (0: unknown)")
    checked = Rollouts([], [], [], [], [], computed_tokens=int(computed))
    for i in range(samples):
        prompt, ids, logprobs = _checked_row(rollouts, i, max_new_tokens, vocabulary, eos)
        checked.prompt_ids.append(prompt)
        checked.completion_ids.append(ids)
        checked.sampler_logprobs.append(logprobs)
        checked.truncated.append(rollouts.truncated[i])
        checked.completions.append(rollouts.completions[i])
    return checked


def _checked_row(
    rollouts: Rollouts, i: int, max_new_tokens: int, vocabulary: int, eos: int | None
) -> tuple[list[int], list[int], list[float]]:
    """Sample i's (prompt ids, completion ids, log-probs): ids of the vocabulary, a prompt, at most
    `max_new_tokens` completion tokens with their log-probs (`_logprobs`), a bool and a string. An empty
    completion that stopped gets the EOS with an unknown log-prob, as the built-in engines give it when a
    server stops without listing it."""
    prompt, ids, truncated = rollouts.prompt_ids[i], rollouts.completion_ids[i], rollouts.truncated[i]
    for name, row in (("prompt_ids", prompt), ("completion_ids", ids)):
        why = _ids_problem(row, vocabulary)
        if why is not None:
            raise ValueError(f"{name}[{i}]{why}")
    if not prompt:
        raise ValueError(f"prompt_ids[{i}] is empty: each sample's prompt has its token ids")
    if len(ids) > max_new_tokens:
        raise ValueError(
            f"completion_ids[{i}] has {len(ids)} tokens, more than max_new_tokens={max_new_tokens}"
        )
    if not isinstance(truncated, bool):
        raise ValueError(f"truncated[{i}] is {truncated!r}, not a bool")
    if not isinstance(rollouts.completions[i], str):
        raise ValueError(
            f"completions[{i}] is a {type(rollouts.completions[i]).__name__}, not the decoded text"
        )
    logprobs, why = _logprobs(rollouts.sampler_logprobs[i], list(ids), eos)
    if why is not None:
        raise ValueError(f"sampler_logprobs[{i}]{why}")
    if not ids:  # it stopped at once: on the EOS, which it did not list
        if truncated or eos is None:
            said = f"truncated[{i}] says it hit max_new_tokens" if truncated else "the tokenizer has no EOS"
            raise ValueError(f"completion_ids[{i}] is empty, and {said}")
        return [int(t) for t in prompt], [eos], [math.nan]
    return [int(t) for t in prompt], [int(t) for t in ids], logprobs


@dataclass
class CheckedSampler:
    """A sampler of the user's own (rollout.engine=file.py:function), named `name`, whose rollouts are
    checked (`check_rollouts`) against the trainer's tokenizer: a call that raises, or returns what no
    model could give, is one ServerError line naming the sampler and the field (exit code 8). Anything
    else is the sampler's own."""

    sampler: Any
    name: str
    tokenizer: PreTrainedTokenizerBase

    @property
    def current(self) -> bool:
        return self.sampler.current

    def generate(
        self, prompts: list[str], *, group_size: int, max_new_tokens: int, **options: Any
    ) -> Rollouts:
        try:
            rollouts = self.sampler.generate(
                prompts, group_size=group_size, max_new_tokens=max_new_tokens, **options
            )
        except ServerError:
            raise  # a server's own line, named already
        except (Exception, SystemExit) as error:
            where = raised_where(error, self.sampler.generate)
            raise ServerError(
                f"rollout.engine: the sampler {self.name!r} {raised(error, 'sampler')}{where}"
            ) from error
        try:
            return check_rollouts(
                rollouts,
                samples=len(prompts) * group_size,
                max_new_tokens=max_new_tokens,
                vocabulary=len(self.tokenizer),
                eos=self.tokenizer.eos_token_id,
            )
        except ValueError as error:
            raise ServerError(
                f"rollout.engine: the sampler {self.name!r} returned {error}; no model gives such rollouts "
                "(gspo.rollout.samplers.Rollouts says what each field holds)"
            ) from None

    def sync_weights(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, step: int) -> None:
        try:
            self.sampler.sync_weights(model, tokenizer, step)
        except ServerError:
            raise
        except (Exception, SystemExit) as error:
            where = raised_where(error, self.sampler.sync_weights)
            raise ServerError(
                f"rollout.engine: the sampler {self.name!r}'s sync_weights {raised(error, 'sampler')}{where}"
            ) from error

    def __getattr__(self, name: str) -> Any:
        if name == "sampler":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.sampler, name)
