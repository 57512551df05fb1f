"""Group-relative advantages (GRPO/GSPO): each return compared with the other samples of its prompt.

The standard deviation is the population one (divide by n), defined for groups of one; the paper writes
"std" without saying which. TRL and verl use the sample std, which makes their advantages smaller by
sqrt((n - 1) / n), e.g. 0.935 for n = 8. A group whose returns are all equal has no signal: its
advantages are exactly 0 (not 0 / eps rounding noise), and it is flagged so callers can count or drop it.
"""

from __future__ import annotations

import torch
from torch import Tensor

SCALES = ("group", "batch", "none")
ADVANTAGE_EPS = 1e-6
"""Added to the standard deviation in the denominator."""


def group_advantages(
    rewards: Tensor, groups: int | Tensor, *, scale: str = "group", eps: float = ADVANTAGE_EPS
) -> tuple[Tensor, Tensor]:
    """Group-normalised advantages: A_i of the GSPO paper's Eq. 6 (the same as GRPO's), or per turn.

    One reward per sample, rewards (B,):
        A_i = (r_i - mean_g r) / (std_g r + eps)
    Returns-to-go per turn, rewards (B, K): column k is G_i,k, the return from the sample's k-th turn on
    (column 0 its total return; NaN where the sample has fewer turns), and
        A_i,k = (G_i,k - mean_g G_i,0) / (std_g{all G_i,k} + eps)
    with the group's mean total return as baseline (a constant: the gradient stays unbiased).

    std is that of the group (scale="group", the paper's), of the whole batch ("batch"), or 1 ("none").

    Args:
        rewards: (B,) or (B, K) any real dtype, computed in float32.
        groups: the group size G (samples of a group adjacent, G dividing B), or (B,) long group ids
            0..num_groups-1 (groups of any sizes).

    Returns:
        (advantages like rewards, float32, NaN where rewards is; zero_std (num_groups,) bool).

    Raises:
        ValueError naming the sample: a non-finite total reward; also a bad shape, group size or scale.
    """
    if scale not in SCALES:
        raise ValueError(f"group_advantages: unknown scale {scale!r}; choose one of {SCALES}")
    if rewards.dim() not in (1, 2):
        raise ValueError(
            f"group_advantages: rewards must be (B,) or (B, K), got shape {tuple(rewards.shape)}"
        )
    r = rewards.detach().to(torch.float32)
    B = r.shape[0]
    if isinstance(groups, int):
        if groups < 1:
            raise ValueError(f"group_advantages: group_size must be >= 1, got {groups}")
        if B % groups:
            raise ValueError(
                f"group_advantages: batch size {B} is not divisible by group_size {groups} "
                f"(every prompt needs exactly group_size samples)"
            )
        groups = torch.arange(B) // groups
    if groups.shape != (B,):
        raise ValueError(f"group_advantages: groups must be ({B},) group ids, got {tuple(groups.shape)}")
    total = r if r.dim() == 1 else r[:, 0]  # (B,)
    present = ~torch.isnan(r)  # absent turns
    bad = ~torch.isfinite(total) | (present & ~torch.isfinite(r)).reshape(B, -1 if B else 1).any(1)
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"group_advantages: reward at sample index {i} (group {int(groups[i])}) is "
            f"{r[i].tolist()}; check the reward function for that sample"
        )
    num_groups = int(groups.max()) + 1 if B else 0
    members = [(groups == g).nonzero().squeeze(1) for g in range(num_groups)]
    batch_std = r[present].std(unbiased=False) if B else r.new_zeros(())
    advantages = torch.full_like(r, float("nan"))
    zero_std = torch.zeros(num_groups, dtype=torch.bool)
    for g, idx in enumerate(members):
        values = r[idx][present[idx]]  # every return of the group
        # equality, not std == 0: a constant group's float mean can differ from its values in the last bit
        zero_std[g] = bool((values == values[0]).all()) if values.numel() else True
        # A = G - mean_g G_total, then divided by the group's or the batch's std
        centered = r[idx] - total[idx].mean()
        if scale == "group":
            centered = centered / (values.std(unbiased=False) + eps)
        elif scale == "batch":
            centered = centered / (batch_std + eps)
        advantages[idx] = torch.where(zero_std[g], torch.zeros_like(centered), centered)
    return torch.where(present, advantages, float("nan")), zero_std
