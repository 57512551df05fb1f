"""Sampler vs trainer log-probs: mismatch metrics and the truncated importance-sampling correction.

The engine that sampled a completion (pi_sampler: its kernels, quantisation, batch shapes) and the trainer
that scores it (pi_old: the same weights in fp32 torch) disagree a little on every token. Which of the two
serves as the old policy is `train.old_logprobs`:
  "recompute"  pi_old is the trainer's own forward pass before the updates: the first minibatch's ratios
               are exactly 1, but the samples are slightly off-policy for pi_old.
  "sampler"    pi_old is the engine's log-probs: no extra forward pass, and the mismatch enters the ratio
               from the first minibatch on.
The GSPO paper (section 5.4) argues that the length-normalised sequence ratio tolerates this mismatch far
better than token ratios; these metrics measure it on every rollout batch where both are available.

Per sequence i, over its trained tokens t that have a sampler log-prob (a token the engine did not report
is NaN and skipped):
  delta_t   = log pi_old(y_t) - log pi_sampler(y_t)          token log-ratio            (M,)
  log rho_i = (1/|y_i|) sum_t delta_t                          length-normalised sequence log-ratio  (S,)
rho_i is exactly GSPO's s_i at the first minibatch of `old_logprobs=sampler` (current = pi_old there).

Metrics (floats; absent when no token has both log-probs):
  sampler_logprob_abs_diff          mean_t |delta_t|
  sampler_token_log_ratio_abs_max   max_t |delta_t|
  sampler_token_outside_clip_frac   share of tokens with exp(delta_t) outside GRPO's [1 - 0.2, 1 + 0.27]
  sampler_seq_log_ratio_{mean,min,max,abs_mean}   the distribution of log rho_i over sequences
  sampler_seq_outside_clip_frac     share of sequences with rho_i outside GSPO's [1 - 3e-4, 1 + 4e-4]: the
                                    sequences that the mismatch alone would clip (whatever the sign of
                                    their advantage, i.e. an upper bound on what clipping removes)

Truncated importance sampling (`train.sampler_is_cap = C > 0`, with `old_logprobs=recompute`):
  w_i = min(rho_i, C) = min(exp(log rho_i), C)     (S,), a constant (no gradient)
and each sequence's policy loss is multiplied by w_i. The trainer does this by scaling the sequence's
advantages (per sequence or per token) by w_i, which is exact: for w > 0,
-min(s w A, clip(s) w A) = w * -min(s A, clip(s) A), and which branch clips depends only on the sign of A.
Deliberate departure from textbook importance sampling: the weight is the length-normalised (geometric
mean) sequence ratio rather than the product of token ratios, which is unbiased but whose variance grows
with length; this is the quantity GSPO's ratio itself uses. The KL term (beta) is not reweighted.
"""

from __future__ import annotations

import torch
from torch import Tensor

SEQUENCE_CLIP = (3e-4, 4e-4)
"""GSPO's paper clip range (eps_low, eps_high): the band the sequence-level mismatch is measured against."""
TOKEN_CLIP = (0.2, 0.27)
"""GRPO's paper clip range: the band the token-level mismatch is measured against."""


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


def truncated_is_weights(seq_log_ratio: Tensor, cap: float) -> Tensor:
    """w_i = min(exp(log rho_i), cap)   (S,): the truncated importance weight of each sequence."""
    if cap <= 0:
        raise ValueError(f"truncated_is_weights: cap must be > 0, got {cap}")
    return torch.exp(seq_log_ratio).clamp(max=cap)
