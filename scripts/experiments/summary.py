"""A run's metrics as numbers: a metric's series over steps, per-seed headline numbers, mean, spread, noise."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

Records = list[dict[str, Any]]
"""One run's metrics.jsonl (gspo.run.metrics.read_metrics)."""


def series(records: Records, key: str, kind: str = "train") -> dict[int, float]:
    """step -> value of a finite metric in the records of ``kind`` ("train" or "eval")."""
    out = {}
    for r in records:  # a resumed run may repeat steps: the last record wins
        if r["kind"] == kind and isinstance(r.get(key), (int, float)) and math.isfinite(r[key]):
            out[r["step"]] = float(r[key])
    return out


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def spread(values: Sequence[float]) -> float:
    """The sample standard deviation over seeds (0 for one seed)."""
    return statistics.stdev(values) if len(values) > 1 else 0.0


def run_mean(records: Records, key: str, first: int = 1) -> float:
    """Mean of a train metric over steps >= first."""
    return mean([v for s, v in series(records, key).items() if s >= first])


def last_fifth(steps: int) -> int:
    """The first step of the last 20% of ``steps``."""
    return steps - max(1, steps // 5) + 1


OUTCOMES: dict[str, Callable[[Records, int], float]] = {
    "reward_first": lambda r, steps: series(r, "reward_mean").get(1, math.nan),
    "reward_last": lambda r, steps: run_mean(r, "reward_mean", last_fifth(steps)),
    "accuracy_start": lambda r, steps: series(r, "accuracy", "eval").get(0, math.nan),
    "accuracy_end": lambda r, steps: series(r, "accuracy", "eval").get(steps, math.nan),
    "accuracy_best": lambda r, steps: max(series(r, "accuracy", "eval").values(), default=math.nan),
    "eval_reward_end": lambda r, steps: series(r, "reward_mean", "eval").get(steps, math.nan),
    "ratio_token_max_max": lambda r, steps: max(series(r, "ratio_token_max").values(), default=math.nan),
    "ratio_token_min_min": lambda r, steps: min(series(r, "ratio_token_min").values(), default=math.nan),
}
"""Headline numbers of one run of ``steps`` rollout batches: rewards (the last over the last 20% of steps),
held-out accuracy at the start, end and best eval, the run's extreme token ratios."""


def summarise(per_seed: list[Records], steps: int, keys: Sequence[str]) -> dict[str, list[float]]:
    """Per key, one value per seed: an OUTCOMES number, or else the train metric's mean over all steps."""
    return {
        key: [OUTCOMES[key](r, steps) if key in OUTCOMES else run_mean(r, key) for r in per_seed]
        for key in keys
    }


def fmt(values: list[float], percent: bool = False, digits: int = 3) -> str:
    """``mean ± std`` over seeds (the mean alone for one seed), in percent or to ``digits`` decimals."""
    m, s = mean(values), spread(values)
    if math.isnan(m):
        return "n/a"
    if percent:
        return f"{100 * m:.{max(0, digits - 1)}f}%" + (
            f" ± {100 * s:.{max(0, digits - 1)}f}" if len(values) > 1 else ""
        )
    if 0 < abs(m) < 10 ** -(digits - 1):  # e.g. a min token ratio of 3e-5: significant digits
        return f"{m:.2g}" + (f" ± {s:.2g}" if len(values) > 1 else "")
    return f"{m:.{digits}f}" + (f" ± {s:.{digits}f}" if len(values) > 1 else "")


def noise(a: list[float], b: list[float]) -> float:
    """Standard error of the difference of two per-seed means (0.02 at least: 2 eval problems in 100)."""
    se = math.sqrt(spread(a) ** 2 / max(1, len(a)) + spread(b) ** 2 / max(1, len(b)))
    return max(0.02, se)
