"""Group-relative advantages (GRPO/GSPO): each reward compared with the other samples of its prompt.

The batch holds B = num_groups * group_size rewards, the samples of one prompt adjacent:
rewards[g * group_size : (g + 1) * group_size] form group g.

Choices, deliberate:
  * The standard deviation is the population one (``unbiased=False``, divide by n): it is defined for
    group_size 1; the paper writes "std" without saying which. TRL and verl use the sample std (divide
    by n - 1), which makes their advantages smaller by sqrt((n - 1) / n), e.g. 0.935 for n = 8.
  * A group whose rewards are all equal has no signal: its advantages are exactly 0 (not 0 / eps
    rounding noise), and it is flagged in the returned mask so callers can count or drop it.
"""

from __future__ import annotations

import torch
from torch import Tensor

SCALES = ("group", "batch", "none")


def group_advantages(
    rewards: Tensor, group_size: int, *, scale: str = "group", eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """Group-normalised advantages: A_i of the GSPO paper's Eq. 6 (the same as GRPO's).

    A_i = (r_i - mean(r_group)) / (std + eps), with std the population standard deviation of the group
    (scale="group", the paper's choice), of the whole batch (scale="batch"), or no division
    (scale="none"). Groups with identical rewards get A_i = 0 exactly.

    Args:
        rewards: (B,) one scalar reward per sample, groups adjacent; any real dtype.
        group_size: samples per prompt (G in the paper); must divide B.
        scale: "group", "batch" or "none".
        eps: added to the standard deviation in the denominator.

    Returns:
        (advantages (B,) float32, zero_std_groups (B // group_size,) bool).

    Raises:
        ValueError: group_size < 1, B not divisible by group_size, a non-finite reward (its index is
            named), an unknown scale, or rewards that are not 1-D.
    """
    if scale not in SCALES:
        raise ValueError(f"group_advantages: unknown scale {scale!r}; choose one of {SCALES}")
    if group_size < 1:
        raise ValueError(f"group_advantages: group_size must be >= 1, got {group_size}")
    if rewards.dim() != 1:
        raise ValueError(f"group_advantages: rewards must be 1-D (B,), got shape {tuple(rewards.shape)}")
    B = rewards.shape[0]
    if B % group_size:
        raise ValueError(
            f"group_advantages: batch size {B} is not divisible by group_size {group_size} "
            f"(every prompt needs exactly group_size samples)"
        )
    r = rewards.detach().to(torch.float32)
    bad = ~torch.isfinite(r)
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"group_advantages: reward at sample index {i} (group {i // group_size}) is {r[i].item()}; "
            f"check the reward function for that sample"
        )
    grouped = r.view(B // group_size, group_size)  # (G, n)
    # equality, not std == 0: a constant group's float mean can differ from its values in the last bit
    zero_std = (grouped == grouped[:, :1]).all(dim=1)  # (G,)
    # A = r - mean_group(r)   (G, n)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        # A = (r - mean) / (std_group + eps)   (G, n)
        centered = centered / (grouped.std(dim=1, unbiased=False, keepdim=True) + eps)
    elif scale == "batch" and B > 0:
        # A = (r - mean) / (std_batch + eps)   (G, n)
        centered = centered / (r.std(unbiased=False) + eps)
    advantages = torch.where(zero_std[:, None], 0.0, centered)
    return advantages.reshape(B), zero_std
