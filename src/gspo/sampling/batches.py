"""One rollout batch, drawn and scored: G completions of each prompt, their rewards, and (with
rollout.dynamic_sampling) further prompts in place of the groups without a reward spread.

Dynamic sampling (DAPO's, with resampling): a group whose G rewards are all equal gives every sample an
advantage of 0, so it teaches nothing. After the batch's prompts are drawn and scored, further prompts of the
training set are drawn as whole groups, round after round, each round as many as the batch still lacks,
until the batch holds `rollout.prompts_per_step` groups with a spread, or `rollout.max_extra_groups` extra
groups were drawn. With `rollout.keep_solved_groups` a solved group (every completion at the rewards' best:
gspo.rewards.scoring.Rewards.best) counts as learned: no other is drawn in its place, so late in a run, when
most groups are all right, a batch draws few or none. The batch keeps its size either way: its groups with a spread first, then
the earliest groups without one (which move nothing, and keep the loss normaliser, the metrics and the
schedule those of a batch of that size). Round r's prompts and completions come from
`gspo.core.seeds.resample_seed` of the batch's own seed: a batch is the same whenever, and in whichever
thread, it is drawn, and the prompt stream is not touched by the extra draws.

The stages (gspo.sampling.stages) run this module's pure steps: `sample` on the sampling stage, `score` on
the scoring stage, `draw_dynamic` (dynamic sampling's rounds) on the sampling stage, waiting for each
round's scores; `assemble` makes the batch of the rounds.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gspo.config import RolloutConfig
from gspo.core.samples import Sample
from gspo.core.seeds import resample_seed
from gspo.rewards.calling import RewardError
from gspo.rewards.scoring import Rewards
from gspo.rollout.data import Example, batch_fields
from gspo.rollout.samplers import Rollouts, Sampler
from gspo.workers import Workers


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
    flat: list[FlatGroup] = field(default_factory=list)
    """The groups drawn for it whose completions all scored the same (the training side tells the learned
    from the stuck: gspo.sampling.schedule)."""
    logged: dict[str, list[float]] = field(default_factory=dict)
    """What its reward functions logged with ``log_metric``, by name (gspo.rewards.scoring)."""
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
        flat = [FlatGroup(**group) for group in state.get("flat", [])]
        return cls(**{**state, "samples": [Sample(**s) for s in state["samples"]], "flat": flat})


@dataclass(frozen=True)
class FlatGroup:
    """A group whose completions all scored the same: its reward, its most common completion, and the share
    of its completions that are that one (1.0: all G alike, an answer the group agrees on)."""

    reward: float
    answer: str
    agreement: float

    @classmethod
    def of(cls, reward: float, completions: list[str]) -> FlatGroup:
        counts = collections.Counter(c.strip() for c in completions)
        answer, count = counts.most_common(1)[0]
        return cls(reward, answer, count / len(completions))


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
    keep_solved: bool = False
    """rollout.keep_solved_groups: a solved group counts as one with a spread (nothing is drawn in its place)."""


def extra_examples(
    pool: Sequence[Example], n: int, *, seed: int, drawn: set[str], prompt: Callable[[Example], str]
) -> list[Example]:
    """``n`` examples of ``pool`` drawn by ``seed``, without repeats, those whose templated prompt (``prompt``)
    is not in ``drawn`` (the batch's so far) first: a prompt drawn twice in one batch teaches less than two
    prompts. Only the examples it looks at are templated."""
    order = list(range(len(pool)))
    random.Random(f"gspo.resample:{seed}").shuffle(order)
    fresh: list[int] = []
    repeats: list[int] = []
    for i in order:
        if len(fresh) == n:
            break
        (repeats if prompt(pool[i]) in drawn else fresh).append(i)
    picked = (fresh + repeats)[:n]
    while len(picked) < n:  # a pool smaller than the batch: every example again, in the same order
        picked += order[: n - len(picked)]
    return [pool[i] for i in picked]


@dataclass
class Group:
    """One prompt's G completions, scored."""

    prompt: str
    samples: list[Sample]
    completions: list[str]
    per_function: dict[str, list[float]]

    @property
    def spread(self) -> bool:
        return any(s.reward != self.samples[0].reward for s in self.samples)


@dataclass
class Sampled:
    """A round's completions, drawn and not yet scored: what the sampling stage hands the scoring stage."""

    request: Request
    examples: list[Example]
    prompts: list[str]
    rollouts: Rollouts
    seconds: float
    """Drawing them."""


@dataclass
class Scored:
    """A round's groups, scored: what the scoring stage hands back."""

    sampled: Sampled
    groups: list[Group]
    seconds: float
    """Scoring them."""
    logged: dict[str, list[float]] = field(default_factory=dict)
    """What the reward functions logged (``log_metric``)."""


def sample(
    sampler: Sampler,
    cfg: RolloutConfig,
    request: Request,
    examples: list[Example] | None = None,
    prompts: list[str] | None = None,
    seed: int | None = None,
) -> Sampled:
    """The sampling stage's work: G completions of each prompt (the request's, or a resampling round's
    ``examples`` and ``prompts``), drawn with the request's seed (or the round's)."""
    examples = request.examples if examples is None else examples
    prompts = request.prompts if prompts is None else prompts
    t0 = time.perf_counter()
    settings = {"group_size": cfg.group_size, "max_new_tokens": cfg.max_new_tokens, "top_p": cfg.top_p}
    seed = request.seed if seed is None else seed
    rollouts = sampler.generate(prompts, temperature=cfg.temperature, seed=seed, **settings)
    return Sampled(request, examples, prompts, rollouts, time.perf_counter() - t0)


def score(rewards: Rewards, cfg: RolloutConfig, sampled: Sampled, workers: Workers | None = None) -> Scored:
    """The scoring stage's work: the sampled completions scored by the rewards, one group per prompt, each
    completion's reward function told its group (``group_ids``). Raises RewardError."""
    t0 = time.perf_counter()
    G, rollouts, prompts = cfg.group_size, sampled.rollouts, sampled.prompts
    scores = rewards.score(
        [p for p in prompts for _ in range(G)],
        rollouts.completions,
        batch_fields(sampled.examples, repeat=G),
        group_ids=[j for j in range(len(prompts)) for _ in range(G)],
        completion_ids=rollouts.completion_ids,
        example_prompts=[ex.prompt for ex in sampled.examples for _ in range(G)],
        step=sampled.request.step,
        workers=workers,
    )
    values = [float(v) for v in scores.total]
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
                version=sampled.request.version,
            )
            for i in rows
        ]
        per_function = {name: [float(v[i]) for i in rows] for name, v in scores.per_function.items()}
        groups.append(Group(prompt, samples, [rollouts.completions[i] for i in rows], per_function))
    return Scored(sampled, groups, time.perf_counter() - t0, scores.logged)


def solved_by(rewards: Rewards, resampling: Resampling) -> Callable[[Group], bool]:
    """Whether a group is solved and kept (rollout.keep_solved_groups): every completion at the rewards'
    best (a flat group below it is not). Without the setting no group is: every flat group is replaced."""
    if not resampling.keep_solved:
        return lambda group: False
    return lambda group: not group.spread and rewards.solved(group.samples[0].reward)


def draw(
    sampler: Sampler,
    rewards: Rewards | Sequence[tuple[str, Any, float]],
    cfg: RolloutConfig,
    request: Request,
    resampling: Resampling | None = None,
    workers: Workers | None = None,
) -> Drawn:
    """One batch drawn and scored in this thread, the stages one after another (what the stages do in place
    at rollout.lag 0: gspo.sampling.stages); a reward's failure is the batch's (`failed`)."""
    rewards = rewards if isinstance(rewards, Rewards) else Rewards.of(rewards)

    def scores(sampled: Sampled) -> Scored:
        return score(rewards, cfg, sampled, workers)

    try:
        if resampling is None:
            return assemble(request, [scores(sample(sampler, cfg, request))])
        return draw_dynamic(sampler, cfg, request, resampling, scores, solved_by(rewards, resampling))
    except RewardError as error:
        return failed(request, 0.0, error)


def draw_dynamic(
    sampler: Sampler,
    cfg: RolloutConfig,
    request: Request,
    resampling: Resampling,
    scores: Callable[[Sampled], Scored],
    solved: Callable[[Group], bool],
) -> Drawn:
    """Dynamic sampling, a policy of the sampling stage (module docstring): the request's groups, then round
    after round of further ones, each round's scores from the scoring stage (``scores``) before the next is
    drawn, until as many groups have a spread or are ``solved`` (learned: none is drawn in place of one) as
    the request has prompts, or the cap is reached."""
    rounds = [scores(sample(sampler, cfg, request))]
    extra, round_ = 0, 0
    while extra < resampling.max_groups:
        groups = [g for r in rounds for g in r.groups]
        missing = len(request.prompts) - sum(g.spread or solved(g) for g in groups)
        if missing <= 0:
            break
        n = min(missing, resampling.max_groups - extra)
        round_seed = resample_seed(request.seed, round_)
        examples = extra_examples(
            resampling.pool, n, seed=round_seed, drawn={g.prompt for g in groups}, prompt=resampling.prompt
        )
        prompts = [resampling.prompt(ex) for ex in examples]
        rounds.append(scores(sample(sampler, cfg, request, examples, prompts, round_seed)))
        extra, round_ = extra + n, round_ + 1
    return assemble(request, rounds)


def failed(request: Request, seconds: float, error: RewardError) -> Drawn:
    """A batch whose scoring failed: the error, raised on every rank together by the training side."""
    return Drawn(request.step, request.version, [], list(request.prompts), [], {}, seconds, 0.0, str(error))


def assemble(request: Request, rounds: list[Scored]) -> Drawn:
    """The batch of the drawn rounds' groups: the first with a spread, then (the cap reached, or the rest
    solved) the earliest without one, in the order drawn, as many as the request has prompts."""
    groups = [g for r in rounds for g in r.groups]
    wanted = len(request.prompts)
    spread = [i for i, g in enumerate(groups) if g.spread][:wanted]
    fillers = [i for i, g in enumerate(groups) if not g.spread][: wanted - len(spread)]
    kept = [groups[i] for i in sorted(spread + fillers)]
    samples = [dataclasses.replace(s, group=j) for j, group in enumerate(kept) for s in group.samples]
    names = kept[0].per_function if kept else {}
    per_function = {name: [v for group in kept for v in group.per_function[name]] for name in names}
    scoring = sum(r.seconds for r in rounds)
    return Drawn(
        request.step,
        request.version,
        samples,
        [g.prompt for g in kept],
        [c for g in kept for c in g.completions],
        per_function,
        sum(r.sampled.seconds for r in rounds) + scoring,
        float(sum(r.sampled.rollouts.computed_tokens for r in rounds)),
        groups_drawn=len(groups),
        groups_kept=len(spread),
        flat=[FlatGroup.of(g.samples[0].reward, g.completions) for g in groups if not g.spread],
        logged={
            name: [v for r in rounds for v in r.logged.get(name, [])] for r in rounds for name in r.logged
        },
        scoring_seconds=scoring,
    )
