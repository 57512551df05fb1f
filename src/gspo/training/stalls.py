"""What a run's train lines say of a run that has stopped learning: `FlatWatch` tells a collapse (groups that
agree on a wrong answer) from saturation (groups all right) and from weights that do not move, with the step
each began; the progress output says it as it happens and summary.md afterwards."""

from __future__ import annotations

from collections.abc import Mapping

from gspo.config import Config

COLLAPSE_SHARE = 0.5
"""A batch is collapsing when at least this share of its groups agree on an answer below the rewards' best."""
SATURATED_SHARE = 0.75
"""A batch is saturated when at least this share of its groups scored the rewards' best in every sample."""


class FlatWatch:
    """Tells a run that has stopped learning, once each, when a streak of ``after`` rollout batches in a row
    shows it (`update` returns the notes due at a step; `postfix` is what the progress bar shows meanwhile):

    - **collapsed**: at least half of each batch's groups agree on one answer that scores below the rewards'
      best (their G completions alike and scored alike, `groups_agreeing`): every advantage of theirs is 0,
      so nothing moves them off it;
    - **saturated**: at least 3/4 of each batch's groups scored the best in every sample (`groups_solved`):
      the training prompts are learned, not stuck;
    - a zero gradient norm at every update: the weights did not move.

    It reads only a train line's metrics, so `gspo.training.plots.write_summary` says the same of a run
    folder afterwards. The note names the step the streak began and the settings that help."""

    def __init__(self, config: Config | None, after: int | None = None) -> None:
        """``config``: the run's (None: a run folder's that could not be read: the notes name no setting of
        its own); ``after``: the streak's length (None: train.warn_after_flat_steps)."""
        self.config = config
        self.after = after if after is not None else (config or Config()).train.warn_after_flat_steps
        self.streaks = {"collapsed": 0, "saturated": 0, "still": 0}
        self.began: dict[str, int] = {}
        """The step each kind's first due streak began (what summary.md reports)."""
        self.answer: str | None = None

    def update(self, step: int, metrics: Mapping[str, float], answer: str | None = None) -> list[str]:
        """The notes due after rollout batch ``step``; ``answer``: what the most stuck groups agreed on."""
        if not self.after:
            return []
        drawn = metrics.get("groups_drawn")
        if not drawn:  # a line of a run older than these metrics: nothing to tell
            return []
        states = {
            "collapsed": metrics.get("groups_agreeing", 0.0) >= COLLAPSE_SHARE * drawn,
            "saturated": metrics.get("groups_solved", 0.0) >= SATURATED_SHARE * drawn,
            # a step that trained nothing (every group filtered out) has no gradient at all
            "still": metrics.get("grad_norm", 0.0) == 0.0,
        }
        if states["collapsed"] and answer is not None:
            self.answer = answer
        due = []
        for kind, now in states.items():
            self.streaks[kind] = self.streaks[kind] + 1 if now else 0
            if self.streaks[kind] == self.after and kind not in self.began:
                self.began[kind] = step - self.after + 1
                due.append(self.note(kind, step))
        return due

    def note(self, kind: str, step: int) -> str:
        """The words for a streak of ``kind`` from `began` to ``step``."""
        steps = f"steps {self.began[kind]}-{step}" if step > self.began[kind] else f"step {step}"
        if kind == "collapsed":
            said = f" (e.g. {self.answer!r})" if self.answer else ""
            return (
                f"warning: collapse: in {steps}, at least half of each rollout batch's groups agree on one answer{said} "
                "that scores below the rewards' best, so their advantages are 0 and nothing moves them off it; "
                f"{collapse_remedies(self.config)}"
            )
        if kind == "saturated":
            return (
                f"note: saturated: in {steps}, at least 3/4 of each rollout batch's groups scored the rewards' best in "
                "every completion: the training prompts are learned (the held-out accuracy says whether it "
                "generalises); fewer train.steps or harder problems would spend the time better"
            )
        return (
            f"warning: {steps}: the gradient norm was 0 at every update, so the weights did not move (zero advantages, "
            "or no trainable parameter reached by the loss)"
        )

    def postfix(self) -> dict[str, str]:
        shown = {"collapsed": "collapse", "saturated": "saturated", "still": "zero grad"}
        now = [label for kind, label in shown.items() if self.after and self.streaks[kind] >= self.after]
        return {"warn": ", ".join(now)} if now else {}


def collapse_remedies(config: Config | None) -> str:
    """The settings that pulled the default run's seeds out of the collapse, those not already set, with
    values that worked (docs/performance.md), and what to look at when they are all set."""
    dynamic = config is not None and config.rollout.dynamic_sampling
    temperature = config.rollout.temperature if config is not None else 1.0
    missing = []
    if not dynamic:
        missing.append("rollout.dynamic_sampling=true (other prompts drawn in place of the stuck groups)")
    if temperature < 1.2:
        missing.append("rollout.temperature=1.2 (completions that differ more, so a group has a spread)")
    shaping = "a shaping reward that pays the agreed wrong answer (a format reward) weighed less"
    if missing:
        return f"what helps: {' and '.join(missing)}; or {shaping}"
    return f"dynamic sampling and temperature {temperature:g} are on already: what helps next: {shaping}"
