"""What a run shows as it goes, and what it leaves at its end.

`Progress`: a progress bar in a terminal, else (piped, under nohup, in an IDE) a line per rollout batch and
per evaluation; nothing with progress=false or on ranks but the first. `FlatWatch`: a note, once, for a run
that has stopped learning: collapsed (groups agree on a wrong answer), saturated (groups all right) or still
(a zero gradient norm); each looks like a quiet, healthy run in the loss curve, so the run goes on (it may
recover) but says so on stderr and in the bar. `report`: the plots and summary.md of a run folder.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from gspo.config import Config
from gspo.learning.policy import UpdateSpec
from gspo.parallel.group import is_main
from gspo.training.stalls import FlatWatch


def skip_notice(config: Config, spec: UpdateSpec) -> str:
    """The terminal's first line, in words a newcomer reads: whether the completions that teach nothing
    (all of their group scored the same) are left out of the updates, and the key that says so."""
    if spec.skip_zero_advantage:
        state = "skipped in the updates, which changes no weight and saves their time"
    elif config.train.skip_zero_advantage == "auto":
        state = "trained anyway: a term of the loss (train.beta, train.entropy_coef) depends on every one"
    else:
        state = "trained anyway"
    return (
        "gspo: completions that scored the same as the rest of their group teach nothing; they are "
        f"{state} (train.skip_zero_advantage)"
    )


class Progress:
    """A run's progress from ``step`` to train.steps (module docstring)."""

    def __init__(self, config: Config, step: int) -> None:
        self.config = config
        self.stalls = FlatWatch(config)
        self.bar = tqdm(
            total=config.train.steps, initial=step, disable=not self.shows_bar(), desc="gspo", unit="step"
        )

    def shows_bar(self) -> bool:
        """The progress bar: interactive runs only (a terminal)."""
        return self.config.progress and is_main() and sys.stderr.isatty()

    def prints_lines(self) -> bool:
        """Progress as plain lines, one per rollout batch and evaluation: runs without a terminal (piped,
        under nohup, in an IDE), unless progress=false."""
        return self.config.progress and is_main() and not sys.stderr.isatty()

    def note(self, line: str) -> None:
        """A line above the bar, or on stderr without one."""
        if self.shows_bar():
            tqdm.write(line)
        elif self.prints_lines():
            print(line, file=sys.stderr, flush=True)

    def step(self, step: int, metrics: Mapping[str, float], answer: str | None = None) -> None:
        """Rollout batch ``step`` is trained, with ``metrics``: the bar (or a line), and any note of a run that
        stopped learning (``answer``: what the most stuck groups agreed on)."""
        for warning in self.stalls.update(step, metrics, answer):
            if is_main():
                tqdm.write(warning, file=sys.stderr)
        shown = {
            "reward": f"{metrics['reward_mean']:.3f}",
            "clip": f"{metrics.get('clip_frac_token', 0.0):.3f}",
            "gen": f"{metrics['time_rollout']:.1f}s",
            "old": f"{metrics['time_old_logprobs']:.1f}s",
            "upd": f"{metrics['time_update']:.1f}s",
            **self.stalls.postfix(),
        }
        self.bar.update(1)
        self.bar.set_postfix(**shown)
        if self.prints_lines():
            fields = ", ".join(f"{key} {value}" for key, value in shown.items())
            print(f"step {step}/{self.config.train.steps}: {fields}", file=sys.stderr, flush=True)

    def evaluated(self, step: int, result: Mapping[str, float]) -> None:
        self.note(f"step {step}: eval accuracy {result['accuracy']:.3f} (reward {result['reward_mean']:.3f})")

    def close(self) -> None:
        self.bar.close()


def report(run_dir: Path) -> dict[str, Any]:
    """plots/*.png (optional: their packages may be missing) and summary.md of a run folder; returns the
    summary's path and the first and last eval accuracy (None without evaluations)."""
    from gspo.run.metrics import read_metrics
    from gspo.training.plots import plot_run, write_summary

    evals = [r for r in read_metrics(run_dir) if r["kind"] == "eval"]
    try:
        plot_run(run_dir)
    except ImportError as error:  # plots are optional; the metrics are on disk
        print(f"plots skipped: {error}")
    first, last = (evals[0]["accuracy"], evals[-1]["accuracy"]) if evals else (None, None)
    return {"summary": write_summary(run_dir), "eval_accuracy_first": first, "eval_accuracy_last": last}
