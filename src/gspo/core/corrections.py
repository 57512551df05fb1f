"""Sampler vs trainer log-probs: the mismatch measured (metrics) and corrected inside the loss (weights).

The engine that sampled a completion (pi_sampler) and the trainer's old policy (pi_old) disagree a little on
every token. `mismatch_metrics` measures by how much, per token and per sequence (length-normalised, the
quantity GSPO's ratio uses), against the paper's clip bands (docs/sampler_mismatch.md defines each metric).
The correction weights reweigh or drop the policy term of a token or sequence by rho = pi_old / pi_sampler
(TIS: truncated importance sampling; MIS / IcePop: masked importance sampling), or drop a negative-advantage
sequence that drifted too far from the sampler (OPSM, DeepSeek-V3.2's off-policy sequence masking). At
sequence level the ratio is length-normalised, rho_i = exp((1/|y_i|) sum_t log rho_t), like GSPO's s_i.
docs/objectives.md ("Mismatch corrections") has the formulas and sources; gspo.core.registry.CORRECTION_BOUNDS
the default bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gspo.core.registry import PAPER_CLIP
from gspo.core.surrogates import LOG_RATIO_CLAMP, Stream


@dataclass(frozen=True)
class Correction:
    """The corrections one loss applies: an importance weight (``name``, one of gspo.core.registry
    .CORRECTIONS, or None) within [low, high] (None: unbounded on that side), and OPSM's threshold (None:
    off)."""

    name: str | None = None
    low: float | None = None
    high: float | None = None
    opsm_delta: float | None = None


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
    rho = torch.exp(
        log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    )  # the same clamp as the objectives' ratios
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


def correction_weights(
    s: Stream, level: str, sampler_logp: Tensor | None, correction: Correction
) -> tuple[Tensor, dict[str, Tensor]]:
    """The corrections' weight of each term ((S,) for sequence terms, else (N,), by ``level``) and their
    metrics, from the shared pieces of the stream and the sampler's log-probs (N,) (None: OPSM measures
    against old_logp).

    A token the sampler gave no log-prob for (NaN) has log rho_t = 0 (ratio 1) and still counts in |y_i|.
    """
    dtype, valid, count = s.lp.dtype, s.seg.valid, s.seg.count
    with torch.no_grad():
        nonempty, n_tok, n_seq = count > 0, valid.sum().to(dtype).clamp_min(1), (count > 0).sum().clamp_min(1)

        def fractions(flags: Tensor, per_seq: bool, name: str) -> dict[str, Tensor]:
            """Fractions of tokens and (mean per sequence) of flagged tokens; flags (S,) or (N,)."""
            if per_seq:
                seq = torch.where(nonempty, flags.to(dtype), 0.0)  # (S,)
                tok = s.seg.per_token(seq)  # (N,)
            else:
                tok = (flags & valid).to(dtype)  # (N,)
                seq = s.seg.mean(tok)  # (S,)
            return {f"{name}_frac_token": tok.sum() / n_tok, f"{name}_frac_seq": seq.sum() / n_seq}

        metrics: dict[str, Tensor] = {}
        weight = torch.ones_like(count if level == "sequence" else s.lp)
        behaviour = s.old_lp if sampler_logp is None else sampler_logp.detach().to(dtype)
        # (N,) unknown: log rho_t = 0
        behaviour = torch.where(valid & ~torch.isnan(behaviour), behaviour, s.old_lp)
        if correction.name is not None:
            per_seq = correction_level(correction.name) == "sequence"
            # log rho_t = log pi_old - log pi_sampler   (N,);  log rho_i = (1/|y_i|) sum_t log rho_t   (S,)
            log_rho = s.old_lp - behaviour
            if per_seq:
                log_rho = s.seg.mean(log_rho)
            w, truncated, masked = importance_weights(
                log_rho, correction.name, correction.low, correction.high
            )
            weight = weight * (w if level == "sequence" or not per_seq else s.seg.per_token(w))
            metrics |= fractions(truncated, per_seq, "sampler_is_truncated")
            metrics |= fractions(masked, per_seq, "sampler_is_masked")
            per_token = s.seg.per_token(w) if per_seq else w  # (N,) each token's weight
            metrics["sampler_is_weight_mean"] = (per_token * valid).sum() / n_tok
            metrics["sampler_is_weight_max"] = torch.where(valid, per_token, float("-inf")).max()
        if correction.opsm_delta is not None:
            # KL_i = (1/|y_i|) sum_t (log pi_sampler - log pi_theta)   (S,), the current policy detached
            seq_kl = s.seg.mean(behaviour - s.lp.detach())
            per_seq = s.adv_seq is not None
            if per_seq:
                drop = opsm_drop(seq_kl, s.adv_seq, correction.opsm_delta)  # (S,)
                keep = (~drop).to(dtype)
                weight = weight * (keep if level == "sequence" else s.seg.per_token(keep))
            else:  # per-token advantages (token terms only): the negative tokens of a drifted sequence
                drop = opsm_drop(s.seg.per_token(seq_kl), s.adv_token, correction.opsm_delta)  # (N,)
                weight = weight * (~drop).to(dtype)
            metrics |= fractions(drop, per_seq, "opsm_masked")
    return weight, metrics


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
