"""Warnings for a run that has stopped learning: rollout batches in a row with no reward spread in any
group (every advantage 0), or with a zero gradient norm. Both look like a quiet, healthy run in the loss
curve; the run goes on (it may recover), but says so on stderr and in the progress bar."""

from __future__ import annotations

from collections.abc import Mapping


class StallWatch:
    """Counts the current streaks; ``update`` returns the warnings that become due at this step (once per
    streak, when it reaches ``after`` steps); ``postfix`` is what the progress bar shows meanwhile."""

    def __init__(self, after: int, groups_per_step: int) -> None:
        self.after, self.groups = after, groups_per_step
        self.flat = 0
        self.still = 0

    def update(self, step: int, metrics: Mapping[str, float]) -> list[str]:
        if not self.after:
            return []
        flat = metrics.get("zero_std_groups", 0.0) >= self.groups
        # a step that trained nothing (every group filtered out) has no gradient at all
        still = metrics.get("grad_norm", 0.0) == 0.0
        self.flat = self.flat + 1 if flat else 0
        self.still = self.still + 1 if still else 0
        due = []
        if self.flat == self.after:
            due.append(
                f"steps {step - self.after + 1}-{step}: every group's completions got the same reward, so "
                "every advantage is 0 and nothing is learned; the rewards may be saturated (all right or "
                "all wrong): try a lower train.lr, a larger rollout.group_size, a higher "
                "rollout.temperature or a shaping reward"
            )
        if self.still == self.after:
            due.append(
                f"steps {step - self.after + 1}-{step}: the gradient norm was 0 at every update, so the "
                "weights did not move (zero advantages, or no trainable parameter reached by the loss)"
            )
        return due

    def postfix(self) -> dict[str, str]:
        stalled = [
            label
            for label, streak in (("no reward spread", self.flat), ("zero grad", self.still))
            if self.after and streak >= self.after
        ]
        return {"warn": ", ".join(stalled)} if stalled else {}
