"""One rollout batch, drawn and scored: G completions of each prompt, their rewards, and (with
rollout.dynamic_sampling) further prompts in place of the groups without a reward spread.

Dynamic sampling (DAPO's, with resampling): a group whose G rewards are all equal gives every sample an
advantage of 0, so it teaches nothing. After the batch's prompts are drawn and scored, further prompts of the
training set are drawn as whole groups, round after round, each round as many as the batch still lacks,
until the batch holds `rollout.prompts_per_step` groups with a spread, or `rollout.max_extra_groups` extra
groups were drawn. The batch keeps its size either way: its groups with a spread first, then, when the cap
was reached, the earliest groups without one (which move nothing, and keep the loss normaliser, the metrics
and the schedule those of a batch of that size). Round r's prompts and completions come from
`gspo.core.seeds.resample_seed` of the batch's own seed: a batch is the same whenever, and in whichever
thread, it is drawn, and the prompt stream is not touched by the extra draws.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gspo.config import RolloutConfig
from gspo.core.samples import Sample
from gspo.core.seeds import resample_seed
from gspo.rewards.calling import RewardError, RewardFunction, compute_rewards
from gspo.rollout.data import Example, batch_fields
from gspo.rollout.samplers import Rollouts, Sampler


@dataclass
class Drawn:
    """One rollout batch as the sampling side leaves it (this rank's share): scored samples, each carrying
    the version that drew it, and what the training side reduces over ranks and logs."""

    step: int
    """The step that trains it."""
    version: int
    """The version of the weights that drew it."""
    samples: list[Sample]
    prompts: list[str]
    """One per group."""
    completions: list[str]
    per_function: dict[str, list[float]]
    """Each reward function's values."""
    seconds: float
    """Drawing and rewarding it."""
    generation_tokens: float
    failure: str | None = None
    """A reward function's error, raised on every rank together by the training side."""
    groups_drawn: int = 0
    """Groups sampled for it, the extra ones of dynamic sampling included."""
    groups_kept: int = 0
    """Groups of the batch with a reward spread."""
    scoring_seconds: float = 0.0
    """Scoring it (of `seconds`)."""

    def rows(self, group_size: int) -> list[dict[str, Any]]:
        """Its completions as RUN/completions.jsonl keeps them: the step, prompt, completion and reward."""
        return [
            {
                "step": self.step,
                "prompt": self.prompts[i // group_size],
                "completion": text,
                "reward": s.reward,
            }
            for i, (text, s) in enumerate(zip(self.completions, self.samples, strict=True))
        ]

    def state(self) -> dict[str, Any]:
        """Plain data for a checkpoint (torch.load's weights_only)."""
        out = dataclasses.asdict(self)
        out["samples"] = [dataclasses.asdict(s) for s in self.samples]
        return out

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Drawn:
        return cls(**{**state, "samples": [Sample(**s) for s in state["samples"]]})


@dataclass(frozen=True)
class Request:
    """What the sampling side needs to draw batch `step`: its prompts, their examples' fields, its seed,
    and the version of the weights it is drawn from."""

    step: int
    version: int
    examples: list[Example]
    prompts: list[str]
    seed: int


@dataclass(frozen=True)
class Resampling:
    """Where dynamic sampling draws its further prompts: the training examples, templated by ``prompt``
    (with the sampling side's own tokenizer), and at most ``max_groups`` extra groups per batch."""

    pool: Sequence[Example]
    prompt: Callable[[Example], str]
    max_groups: int


def extra_examples(pool: Sequence[Example], n: int, *, seed: int, drawn: set[str]) -> list[Example]:
    """``n`` examples of ``pool`` drawn by ``seed``, without repeats, those whose prompt is not in ``drawn``
    (the batch's so far) first: a prompt drawn twice in one batch teaches less than two prompts."""
    order = list(range(len(pool)))
    random.Random(f"gspo.resample:{seed}").shuffle(order)
    fresh = [i for i in order if pool[i].prompt not in drawn]
    repeats = [i for i in order if pool[i].prompt in drawn]
    picked = (fresh + repeats)[:n]
    while len(picked) < n:  # a pool smaller than the batch: every example again, in the same order
        picked += order[: n - len(picked)]
    return [pool[i] for i in picked]


@dataclass
class _Group:
    prompt: str
    samples: list[Sample]
    completions: list[str]
    per_function: dict[str, list[float]]

    @property
    def spread(self) -> bool:
        return any(s.reward != self.samples[0].reward for s in self.samples)


@dataclass
class Sampled:
    """A batch's completions, drawn and not yet scored: what the sampling stage hands the scoring stage."""

    request: Request
    rollouts: Rollouts
    seconds: float
    """Drawing them."""


def sample(sampler: Sampler, cfg: RolloutConfig, request: Request) -> Sampled:
    """The sampling stage: G completions of each of the request's prompts, with its seed."""
    t0 = time.perf_counter()
    rollouts = _generate(sampler, cfg, request.prompts, request.seed)
    return Sampled(request, rollouts, time.perf_counter() - t0)


def score(rewards: list[tuple[str, RewardFunction, float]], cfg: RolloutConfig, sampled: Sampled) -> Drawn:
    """The scoring stage: the sampled completions scored by the rewards (a batch without dynamic sampling's
    extra draws, whose rounds need the scores before they sample: `draw`)."""
    t0 = time.perf_counter()
    request = sampled.request
    try:
        groups = _groups(rewards, cfg, request.examples, request.prompts, sampled.rollouts, request.version)
    except RewardError as error:
        return _failed(request, sampled.seconds + time.perf_counter() - t0, error)
    scoring = time.perf_counter() - t0
    return _batch(
        request, groups, float(sampled.rollouts.computed_tokens), sampled.seconds + scoring, scoring
    )


def draw(
    sampler: Sampler,
    rewards: list[tuple[str, RewardFunction, float]],
    cfg: RolloutConfig,
    request: Request,
    resampling: Resampling | None = None,
) -> Drawn:
    """Draw and reward one batch, both stages in this thread (module docstring): G completions of each
    prompt, scored by the rewards, with further groups in place of those without a spread when
    ``resampling`` is given. No collective: the training side reduces over ranks."""
    if resampling is None:
        return score(rewards, cfg, sample(sampler, cfg, request))
    t0 = time.perf_counter()
    clock = _Clock()
    try:
        groups, tokens = _drawn_groups(
            sampler, rewards, cfg, request.examples, request.prompts, request.seed, request.version, clock
        )
        groups, tokens = _resample(sampler, rewards, cfg, request, resampling, groups, tokens, clock)
    except RewardError as error:
        return _failed(request, time.perf_counter() - t0, error)
    return _batch(request, groups, tokens, time.perf_counter() - t0, clock.scoring)


@dataclass
class _Clock:
    scoring: float = 0.0
    """Seconds spent scoring."""


def _generate(sampler: Sampler, cfg: RolloutConfig, prompts: list[str], seed: int) -> Rollouts:
    settings = {"group_size": cfg.group_size, "max_new_tokens": cfg.max_new_tokens, "top_p": cfg.top_p}
    return sampler.generate(prompts, temperature=cfg.temperature, seed=seed, **settings)


def _groups(
    rewards: list[tuple[str, RewardFunction, float]],
    cfg: RolloutConfig,
    examples: list[Example],
    prompts: list[str],
    rollouts: Rollouts,
    version: int,
) -> list[_Group]:
    """The rollouts scored, one group per prompt. Raises RewardError."""
    G = cfg.group_size
    total, per_function = compute_rewards(
        rewards,
        [p for p in prompts for _ in range(G)],
        rollouts.completions,
        batch_fields(examples, repeat=G),
    )
    values = [float(v) for v in total]
    groups = []
    for j, prompt in enumerate(prompts):
        rows = range(j * G, (j + 1) * G)
        samples = [
            Sample(
                rollouts.prompt_ids[i],
                rollouts.completion_ids[i],
                rollouts.sampler_logprobs[i],
                values[i],
                group=j,
                truncated=rollouts.truncated[i],
                version=version,
            )
            for i in rows
        ]
        scores = {name: [float(v[i]) for i in rows] for name, v in per_function.items()}
        groups.append(_Group(prompt, samples, [rollouts.completions[i] for i in rows], scores))
    return groups


def _drawn_groups(
    sampler: Sampler,
    rewards: list[tuple[str, RewardFunction, float]],
    cfg: RolloutConfig,
    examples: list[Example],
    prompts: list[str],
    seed: int,
    version: int,
    clock: _Clock,
) -> tuple[list[_Group], float]:
    """G completions of each prompt, sampled and scored: one group per prompt, and the tokens run through
    the model."""
    rollouts = _generate(sampler, cfg, prompts, seed)
    t0 = time.perf_counter()
    groups = _groups(rewards, cfg, examples, prompts, rollouts, version)
    clock.scoring += time.perf_counter() - t0
    return groups, float(rollouts.computed_tokens)


def _resample(
    sampler: Sampler,
    rewards: list[tuple[str, RewardFunction, float]],
    cfg: RolloutConfig,
    request: Request,
    resampling: Resampling,
    groups: list[_Group],
    tokens: float,
    clock: _Clock,
) -> tuple[list[_Group], float]:
    """``groups`` and the extra ones drawn, round after round, until as many have a spread as the request
    has prompts, or the cap is reached (module docstring); and the tokens run through the model."""
    extra, round_ = 0, 0
    while extra < resampling.max_groups:
        missing = len(request.prompts) - sum(g.spread for g in groups)
        if missing <= 0:
            break
        n = min(missing, resampling.max_groups - extra)
        round_seed = resample_seed(request.seed, round_)
        examples = extra_examples(resampling.pool, n, seed=round_seed, drawn={g.prompt for g in groups})
        prompts = [resampling.prompt(ex) for ex in examples]
        more, more_tokens = _drawn_groups(
            sampler, rewards, cfg, examples, prompts, round_seed, request.version, clock
        )
        groups, tokens, extra, round_ = groups + more, tokens + more_tokens, extra + n, round_ + 1
    return groups, tokens


def _failed(request: Request, seconds: float, error: RewardError) -> Drawn:
    """A batch whose scoring failed: the error, raised on every rank together by the training side."""
    return Drawn(request.step, request.version, [], list(request.prompts), [], {}, seconds, 0.0, str(error))


def _batch(request: Request, groups: list[_Group], tokens: float, seconds: float, scoring: float) -> Drawn:
    """The batch of the drawn ``groups``: the first with a spread, then (the cap reached) the earliest
    without one, in the order drawn, as many as the request has prompts."""
    wanted = len(request.prompts)
    spread = [i for i, g in enumerate(groups) if g.spread][:wanted]
    fillers = [i for i, g in enumerate(groups) if not g.spread][: wanted - len(spread)]
    batch = [groups[i] for i in sorted(spread + fillers)]
    samples = [dataclasses.replace(s, group=j) for j, group in enumerate(batch) for s in group.samples]
    names = batch[0].per_function if batch else {}
    per_function = {name: [v for group in batch for v in group.per_function[name]] for name in names}
    return Drawn(
        request.step,
        request.version,
        samples,
        [g.prompt for g in batch],
        [c for g in batch for c in g.completions],
        per_function,
        seconds,
        tokens,
        groups_drawn=len(groups),
        groups_kept=len(spread),
        scoring_seconds=scoring,
    )
