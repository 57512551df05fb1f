"""Sampler vs trainer log-probs: mismatch metrics.

The engine that sampled a completion (pi_sampler) and the trainer that scores it (pi_old) disagree a little
on every token; these functions measure by how much, per token and per sequence (length-normalised, the
quantity GSPO's ratio uses), against the paper's clip bands. docs/sampler_mismatch.md defines each metric;
the corrections (truncated or masked importance sampling, OPSM) are in gspo.core.corrections.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gspo.core.registry import PAPER_CLIP

SEQUENCE_CLIP = PAPER_CLIP["gspo"]
"""The band the sequence-level mismatch is measured against: GSPO's paper clip range."""
TOKEN_CLIP = PAPER_CLIP["grpo"]
"""The band the token-level mismatch is measured against: GRPO's paper clip range."""


def sampler_log_ratios(
    old_logp: Tensor, sampler_logp: Tensor, segment_ids: Tensor, num_segments: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Token and length-normalised sequence log-ratios of pi_old against pi_sampler in a packed layout.

    Args:
        old_logp, sampler_logp: (N,) log-probs of the same tokens; sampler_logp is NaN where unknown.
        segment_ids: (N,) long, 0..num_segments-1 on trained tokens, -1 elsewhere.
        num_segments: S.

    Returns:
        delta (M,): log pi_old - log pi_sampler on the trained tokens with a finite sampler log-prob;
        seq_log_ratio (S,): (1/|y_i|) sum of delta over each segment's such tokens, 0 for a segment with none;
        counts (S,): how many tokens each segment contributed.
    """
    valid = (segment_ids >= 0) & torch.isfinite(sampler_logp)  # (N,)
    delta = (old_logp.float() - sampler_logp.float())[valid]  # (M,)
    owner = segment_ids[valid]  # (M,)
    counts = torch.zeros(num_segments, device=delta.device).index_add(
        0, owner, torch.ones_like(delta)
    )  # (S,)
    # log rho_i = (1/|y_i|) sum_t delta_t   (S,)
    seq_log_ratio = torch.zeros(num_segments, device=delta.device).index_add(
        0, owner, delta
    ) / counts.clamp_min(1)
    return delta, seq_log_ratio, counts


def mismatch_metrics(delta: Tensor, seq_log_ratio: Tensor) -> dict[str, float]:
    """The metrics of the module docstring from token log-ratios (M,) and sequence log-ratios (S',)."""
    if delta.numel() == 0:
        return {}
    token_ratio = torch.exp(delta)
    seq_ratio = torch.exp(seq_log_ratio)
    (t_low, t_high), (s_low, s_high) = TOKEN_CLIP, SEQUENCE_CLIP
    return {
        "sampler_logprob_abs_diff": float(delta.abs().mean()),
        "sampler_token_log_ratio_abs_max": float(delta.abs().max()),
        "sampler_token_outside_clip_frac": float(
            ((token_ratio < 1 - t_low) | (token_ratio > 1 + t_high)).float().mean()
        ),
        "sampler_seq_log_ratio_mean": float(seq_log_ratio.mean()),
        "sampler_seq_log_ratio_min": float(seq_log_ratio.min()),
        "sampler_seq_log_ratio_max": float(seq_log_ratio.max()),
        "sampler_seq_log_ratio_abs_mean": float(seq_log_ratio.abs().mean()),
        "sampler_seq_outside_clip_frac": float(
            ((seq_ratio < 1 - s_low) | (seq_ratio > 1 + s_high)).float().mean()
        ),
    }
