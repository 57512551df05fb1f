"""The entropy bonus's coefficient: fixed, or adapted toward a target entropy (Skywork-OR1's adaptive
entropy control, arXiv 2505.22312, section 4; TRL's use_adaptive_entropy).

With a target: after each optimizer update, whose minibatch had a mean entropy of e nats per token, the
coefficient rises by ``delta`` while e <= target and falls by it above (kept within [0, max_coef]); the
bonus applies to an update only while the entropy last measured is at or below the target, so a policy that
explores enough is not pushed further. The first update has measured nothing yet: it gets no bonus. The state
(coefficient, last entropy) is part of a checkpoint, so a resumed run adapts as an uninterrupted one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass
class EntropyControl:
    """coef: the coefficient (with a target, its current value, starting from train.entropy_coef); target:
    train.entropy_target (None: a fixed coefficient); delta and max_coef: the adaptive steps and ceiling."""

    coef: float = 0.0
    target: float | None = None
    delta: float = 0.005
    max_coef: float = 1.0
    last: float = math.inf
    """The mean entropy of the last update's minibatch (inf: none measured yet)."""

    @property
    def active(self) -> bool:
        """Whether the updates compute the entropy at all (a coefficient, or a target to measure against)."""
        return self.coef != 0 or self.target is not None

    def applied(self) -> float:
        """The coefficient of the next update."""
        if self.target is None:
            return self.coef
        return self.coef if self.last <= self.target else 0.0

    def observe(self, entropy: float) -> None:
        """An update's minibatch had mean entropy ``entropy``: adapt the coefficient (with a target)."""
        if self.target is None:
            return
        step = self.delta if entropy <= self.target else -self.delta
        self.coef = min(max(self.coef + step, 0.0), self.max_coef)
        self.last = entropy

    def state_dict(self) -> dict[str, Any]:
        return {"coef": self.coef, "last": self.last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.coef, self.last = float(state["coef"]), float(state["last"])
