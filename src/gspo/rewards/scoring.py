"""A run's rewards as one typed object, `Rewards`: the functions (prepared: gspo.rewards.calling), their
weights and names, resolved once (gspo.rewards.resolve.resolve_rewards) and used alike by `gspo train`'s
rollouts, its evaluations, `gspo eval` and TRL's GRPOTrainer (gspo.trl).

`Rewards.score` scores a batch of groups: each completion comes with the index of its group in the batch
(``group_ids``), which a function that takes a ``group_ids`` keyword (or ``**kwargs``) receives, so a
function that judges a group as a whole (the LLM judge) never guesses groups from equal prompts; TRL's
keywords come the same way (``completion_ids``, ``trainer_state``, ``log_metric``: gspo.rewards.calling
.Keywords). The total is the weighted sum in float32 of the values each sample has: a function may return
None for a sample it does not score (TRL's multi-task rewards), which the sum leaves out. `best` is the
highest total there can be where every function declares its best.
"""

from __future__ import annotations

import math
import numbers
import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from gspo.rewards.calling import (
    Keywords,
    Prepared,
    RewardError,
    RewardFunction,
    borrowed,
    prepare,
    score_batch,
)
from gspo.workers import Workers

_FLOAT32_EPS = float(torch.finfo(torch.float32).eps)


class RewardWarning(UserWarning):
    """A batch the rewards scored with a gap: a sample no function scored (all returned None)."""


class Reward(NamedTuple):
    """One reward of a run: its name in metrics and messages, the function as gspo calls it, its weight."""

    name: str
    function: Prepared
    weight: float


@dataclass(frozen=True)
class Scores:
    """A batch's rewards: the weighted sum and each function's values, float32, one per completion."""

    total: torch.Tensor
    """(B,) sum_k weight_k * r_k over the functions that scored the sample."""
    per_function: dict[str, torch.Tensor]
    """Each function's (B,) values, by name; NaN where it returned None."""
    logged: dict[str, list[float]] = field(default_factory=dict)
    """What the functions logged with ``log_metric``, by name."""


@dataclass(frozen=True)
class RewardState:
    """TRL's ``trainer_state`` as a reward function reads it: ``global_step``, the rollout batch's step."""

    global_step: int


class MetricLog:
    """``log_metric(name, value)`` for reward functions: values logged with the step's metrics (from any of
    the run's threads)."""

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def __call__(self, name: str, value: float) -> None:
        if not isinstance(name, str) or isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"log_metric(name, value) takes a name and a number, got {name!r}, {value!r}")
        with self._lock:
            self.values.setdefault(name, []).append(float(value))


@dataclass(frozen=True)
class Rewards:
    """A run's reward functions and weights, in order: the first is the eval accuracy (module docstring)."""

    items: tuple[Reward, ...]

    def __post_init__(self) -> None:
        if not self.items:
            raise ValueError("a run needs at least one reward function")
        names = [r.name for r in self.items]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"reward names must be unique, repeated: {repeated}")
        for r in self.items:
            if not isinstance(r.weight, numbers.Real) or not math.isfinite(r.weight):
                raise ValueError(f"reward {r.name!r} has weight {r.weight!r}; weights must be finite numbers")

    @classmethod
    def of(
        cls,
        functions: Sequence[tuple[str, RewardFunction, float]],
        *,
        timeout: float | None = None,
        concurrency: int | None = None,
    ) -> Rewards:
        """The rewards of (name, function, weight) triples, each function prepared (gspo.rewards.calling)."""
        return cls(
            tuple(
                Reward(name, prepare(function, name, timeout=timeout, concurrency=concurrency), weight)
                for name, function, weight in functions
            )
        )

    def __iter__(self) -> Iterator[Reward]:
        return iter(self.items)

    def __getitem__(self, index: int | slice) -> Any:
        """A reward, or (a slice) the rewards of those."""
        return Rewards(self.items[index]) if isinstance(index, slice) else self.items[index]

    def __len__(self) -> int:
        return len(self.items)

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.items]

    @property
    def accuracy(self) -> str:
        """The first reward's name: its mean on the held-out problems is the eval accuracy."""
        return self.items[0].name

    @property
    def best(self) -> float | None:
        """The highest total a sample can score, sum_k weight_k * best_k, where every function declares its
        best (`gspo.reward(best=...)`, as the built-ins do) and no weight is negative; else None."""
        total = 0.0
        for r in self.items:
            best = getattr(r.function, "gspo_best", None)
            if best is None or r.weight < 0:
                return None
            total += r.weight * best
        return total

    def solved(self, value: float, best: float | None = None) -> bool:
        """Whether a sample's total ``value`` is ``best`` (None: the rewards' `best`; neither known: False),
        to within float32's rounding of a sum of as many terms."""
        best = self.best if best is None else best
        if best is None:
            return False
        return value >= best - 2 * len(self.items) * _FLOAT32_EPS * max(abs(best), 1.0)

    def score(
        self,
        prompts: list[Any],
        completions: list[Any],
        fields: dict[str, list],
        *,
        group_ids: list[int],
        completion_ids: list[list[int]] | None = None,
        example_prompts: list[Any] | None = None,
        step: int = 0,
        workers: Workers | None = None,
    ) -> Scores:
        """Each function's values on the batch and their weighted sum; every list is aligned with
        ``completions`` (B long), ``group_ids`` giving each completion's group, ``completion_ids`` its token
        ids, ``example_prompts`` its example's own prompt (before the chat template: what the judge shows as
        $prompt), ``step`` the rollout batch's (module docstring). ``workers``: the run's threads and loop, which
        the calls borrow (None: ones of this call's own). A function's failure, or a sum beyond float32, is a
        RewardError naming it."""
        per_sample: dict[str, list[Any]] = {"group_ids": group_ids}
        if completion_ids is not None:
            per_sample["completion_ids"] = completion_ids
        if example_prompts is not None:
            per_sample["example_prompts"] = example_prompts
        for key, values in {"prompts": prompts, **per_sample, **fields}.items():
            if len(values) != len(completions):
                raise ValueError(f"{key!r} has {len(values)} entries for {len(completions)} completions")
        log = MetricLog()
        keywords = Keywords(per_sample, {"trainer_state": RewardState(step), "log_metric": log})
        with borrowed(workers) as owned:
            values = score_batch(
                [r.function for r in self.items], prompts, completions, fields, owned, keywords=keywords
            )
        total = torch.zeros(len(completions), dtype=torch.float32)
        scored = torch.zeros(len(completions), dtype=torch.bool)
        per_function = {}
        for r in self.items:
            rewards = torch.tensor(
                [math.nan if v is None else v for v in values[r.name]], dtype=torch.float32
            )
            per_function[r.name] = rewards
            known = ~torch.isnan(rewards)
            total += r.weight * torch.where(known, rewards, 0.0)
            scored |= known
        if not torch.isfinite(total).all():
            raise RewardError(
                f"the weighted sum of the rewards {self.names} overflows float32 at sample "
                f"{int((~torch.isfinite(total)).nonzero()[0])}: lower the weights or the rewards"
            )
        if not scored.all():
            unscored = int((~scored).nonzero()[0])
            warnings.warn(
                f"every reward function returned None for sample {unscored} (completion "
                f"{str(completions[unscored])[:60]!r}): its reward is 0; make one of them score it",
                RewardWarning,
                stacklevel=2,
            )
        return Scores(total, per_function, log.values)


def compute_rewards(
    functions: Sequence[tuple[str, RewardFunction, float]],
    prompts: list[str],
    completions: list[str],
    fields: dict[str, list],
    workers: Workers | None = None,
    *,
    group_ids: list[int] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Score the batch with each (name, function, weight) and combine: ``(total, {name: rewards})``, float32
    tensors of B values (`Rewards.score`; a plain function is called as a batch function with no deadline;
    `prepare` says how to call it otherwise). ``group_ids``: each completion's group (default: one group)."""
    if not functions:
        raise ValueError("compute_rewards needs at least one reward function")
    rewards = functions if isinstance(functions, Rewards) else Rewards.of(functions)
    scores = rewards.score(
        prompts, completions, fields, group_ids=group_ids or [0] * len(completions), workers=workers
    )
    return scores.total, scores.per_function
