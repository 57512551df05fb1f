"""Train-inference mismatch corrections applied inside the loss, from the sampler's log-probs.

The engine that sampled a completion (pi_sampler) and the trainer's old policy (pi_old) disagree a little on
every token. These weights reweigh or drop the policy term of a token or sequence by rho = pi_old / pi_sampler
(TIS: truncated importance sampling; MIS / IcePop: masked importance sampling), or drop a negative-advantage
sequence that drifted too far from the sampler (OPSM, DeepSeek-V3.2's off-policy sequence masking). At
sequence level the ratio is length-normalised, rho_i = exp((1/|y_i|) sum_t log rho_t), like GSPO's s_i.
docs/objectives.md ("Mismatch corrections") has the formulas, sources and defaults.
"""

from __future__ import annotations

import torch
from torch import Tensor

CORRECTION_BOUNDS: dict[str, tuple[float | None, float | None]] = {
    "token_truncate": (None, 2.0),
    "sequence_truncate": (None, 2.0),
    "token_mask": (0.5, 5.0),
    "sequence_mask": (0.5, 5.0),
}
"""Default [C_min, C_max] per correction (None: unbounded on that side): TIS truncates at C = 2 (Yao et al.,
"Your efficient RL framework secretly brings you off-policy RL training"); masked IS keeps [0.5, 5], IcePop's
band (Ring-1T report)."""
CORRECTIONS = tuple(CORRECTION_BOUNDS)


def correction_level(correction: str) -> str:
    """ "token" or "sequence": the unit a correction weighs."""
    return correction.split("_")[0]


def importance_weights(
    log_rho: Tensor, correction: str, low: float | None, high: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    """The weight of each token or sequence from its (detached) log rho, any shape.

    "*_truncate": w = clip(rho, C_min, C_max); "*_mask": w = rho inside [C_min, C_max], else 0.
    Returns (w, truncated, masked): the weights and where they were truncated or masked (bool).
    """
    rho = torch.exp(log_rho.clamp(-20.0, 20.0))  # the same clamp as the objectives' ratios
    outside = torch.zeros_like(rho, dtype=torch.bool)
    if low is not None:
        outside = outside | (rho < low)
    if high is not None:
        outside = outside | (rho > high)
    if correction.endswith("_truncate"):
        return rho.clamp(min=low, max=high), outside, torch.zeros_like(outside)
    return torch.where(outside, 0.0, rho), torch.zeros_like(outside), outside


def opsm_drop(seq_kl: Tensor, adv: Tensor, delta: float) -> Tensor:
    """OPSM: drop where A < 0 and the sequence's mean log(pi_sampler / pi_theta) exceeds delta (bool, adv's shape).

    seq_kl and adv: (S,) per sequence, or (N,) per token with each token's sequence KL broadcast.
    """
    return (adv < 0) & (seq_kl > delta)
