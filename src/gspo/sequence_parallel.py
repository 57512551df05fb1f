"""Sequence data parallelism: one completion's tokens split across ranks, with the unsplit loss.

For completions too long for one rank, each rank holds a piece of a sequence's tokens. GSPO's ratio is a
mean over the whole sequence, so the per-segment sums (log-ratios, token counts) are all-reduced with a
differentiable all-reduce before any ratio is formed (``segment_sum_reduce`` of the packed objectives,
Fast-LLM's design): the sequence ratio, the clipping decision and the gradient are those of the unsplit
sequence, and :func:`sequence_parallel_loss` reduces the metrics so they are the unsplit ones too.

What is and is not wired: this works at the loss level, for log-probs each rank computed for its own
tokens. The trainer does not split sequences: a rank's piece of a sequence needs the earlier pieces as
attention context (context-parallel attention, e.g. ring attention), which the model code does not do.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gspo.losses import LOG_RATIO_CLAMP, PACKED_OBJECTIVES


def segment_sum_all_reduce(group: dist.ProcessGroup | None = None) -> Callable[[Tensor], Tensor]:
    """A differentiable all-reduce (sum) for the objectives' ``segment_sum_reduce``.

    The backward all-reduces the incoming gradient too: rank r's local sums feed every rank's loss, so
    their gradient is the sum of all ranks' gradients with respect to the reduced sums.
    """
    from torch.distributed.nn.functional import all_reduce

    return functools.partial(all_reduce, op=dist.ReduceOp.SUM, group=group)


_TOKEN_WEIGHTED = ("clip_frac_token", "clip_frac_token_low", "clip_frac_token_high", "log_ratio_abs_mean")


def sequence_parallel_loss(
    objective: str,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    segment_ids: Tensor,
    num_segments: int,
    *,
    eps_low: float,
    eps_high: float,
    group: dist.ProcessGroup | None = None,
    **kwargs: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """One objective when sequences are split across the ranks of ``group``: this rank's loss (to
    backward) and metrics equal to the unsplit batch's on every rank.

    Each rank passes its own tokens (N_r,) with globally consistent ``segment_ids`` (the same id for the
    pieces of one sequence on every rank, 0..num_segments-1), the same per-sequence ``advantages``
    (num_segments,) on every rank, or per-token advantages (N_r,) for its own tokens. The losses summed
    over the ranks are the unsplit loss, and the gradients summed over the ranks (what DDP/FSDP2 do) the
    unsplit gradient. ``normalizer``, when given, must be the global value; the default is global.
    ``kwargs``: aggregation, normalizer, ref_logp, beta, check_finite.

    Metrics: the objective's own metrics are global for what it builds from the reduced per-segment sums;
    the rest are reduced here (sums, token-weighted means, min/max over ranks holding tokens), and the
    per-sequence clip fractions of grpo/gspo_token are recounted from all-reduced per-segment counts.
    """
    reduce = segment_sum_all_reduce(group)
    loss, metrics = PACKED_OBJECTIVES[objective](
        logp, old_logp, advantages, segment_ids, num_segments, eps_low=eps_low, eps_high=eps_high,
        segment_sum_reduce=reduce, **kwargs,
    )  # fmt: skip
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return loss, metrics
    out = dict(metrics)
    n_local = metrics["num_tokens"].double()
    sums = {k: metrics[k].double() * n_local for k in (*_TOKEN_WEIGHTED, "ratio_token_mean")}
    stacked = torch.stack([metrics["loss"].double(), n_local, *sums.values()])
    if "kl" in metrics:
        stacked = torch.cat([stacked, metrics["kl"].double().reshape(1)])
    dist.all_reduce(stacked, group=group)
    n_global = stacked[1].clamp_min(1)
    out["loss"], out["num_tokens"] = stacked[0], stacked[1]
    for i, key in enumerate(sums):
        out[key] = stacked[2 + i] / n_global
    if "kl" in metrics:
        out["kl"] = stacked[-1]
    # extremes over the ranks that hold tokens (an empty rank reports 0 for both)
    has = n_local > 0
    lo = torch.where(has, metrics["ratio_token_min"].double(), float("inf")).reshape(1)
    hi = torch.where(has, -metrics["ratio_token_max"].double(), float("inf")).reshape(1)
    extremes = torch.cat([lo, hi])
    dist.all_reduce(extremes, op=dist.ReduceOp.MIN, group=group)
    any_tokens = stacked[1] > 0
    out["ratio_token_min"] = torch.where(any_tokens, extremes[0], 0.0)
    out["ratio_token_max"] = torch.where(any_tokens, -extremes[1], 0.0)
    if objective != "gspo":  # gspo's per-sequence counts come from the reduced sums already
        out |= _split_sequence_counts(
            objective, logp, old_logp, advantages, segment_ids, num_segments, group=group,
            eps_low=eps_low, eps_high=eps_high,
        )  # fmt: skip
    return loss, {k: v.detach().to(torch.float32) for k, v in out.items()}


def _split_sequence_counts(
    objective: str,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    segment_ids: Tensor,
    num_segments: int,
    *,
    group: dist.ProcessGroup | None,
    eps_low: float,
    eps_high: float,
) -> dict[str, Tensor]:
    """clip_frac_seq* and num_seq_nonzero_adv of a split batch, from all-reduced per-segment counts.

    Mirrors the objectives' definitions (losses.py module docstring): a token is clipped low when A < 0
    and its ratio < 1 - eps_low, high when A > 0 and its ratio > 1 + eps_high; the ratio is the token's
    (grpo) or its sequence's (gspo_token), log-ratios clamped to +-LOG_RATIO_CLAMP. The tests check these
    against the unsplit objective's own metrics.
    """
    S = num_segments
    dtype = torch.promote_types(logp.dtype, torch.float32)
    valid = segment_ids >= 0
    bucket = torch.where(valid, segment_ids, S)

    def segment_sum(x: Tensor) -> Tensor:  # (N,) -> (S,)
        return x.new_zeros(S + 1).index_add(0, bucket, x)[:S]

    lp = torch.where(valid, logp.detach().to(dtype), 0.0)
    log_ratio = lp - torch.where(valid, old_logp.detach().to(dtype), 0.0)
    sums = torch.stack([segment_sum(log_ratio), segment_sum(valid.to(dtype))])  # (2, S)
    dist.all_reduce(sums, group=group)
    count = sums[1]
    if advantages.shape == (S,):
        adv = torch.cat([advantages.detach().to(dtype), advantages.new_zeros(1, dtype=dtype)])[bucket]
    else:
        adv = advantages.detach().to(dtype)
    adv = torch.where(valid, adv, 0.0)
    if objective == "grpo":
        exponent = log_ratio
    else:  # gspo_token: the sequence ratio on every token, evaluated as the objective does (same rounding)
        seq_log_ratio = sums[0] / count.clamp_min(1)
        exponent = torch.cat([seq_log_ratio, seq_log_ratio.new_zeros(1)])[bucket] + lp - lp
    ratio = torch.exp(exponent.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    low = valid & (adv < 0) & (ratio < 1 - eps_low)
    high = valid & (adv > 0) & (ratio > 1 + eps_high)
    counts = torch.stack(
        [segment_sum(low.to(dtype)), segment_sum(high.to(dtype)), segment_sum((adv != 0).to(dtype))]
    )
    dist.all_reduce(counts, group=group)
    present = count > 0
    n_present = present.sum().clamp_min(1)
    frac_low = torch.where(present, counts[0] / count.clamp_min(1), 0.0)
    frac_high = torch.where(present, counts[1] / count.clamp_min(1), 0.0)
    return {
        "clip_frac_seq": (frac_low + frac_high).sum() / n_present,
        "clip_frac_seq_low": frac_low.sum() / n_present,
        "clip_frac_seq_high": frac_high.sum() / n_present,
        "num_seq_nonzero_adv": ((counts[2] > 0) & present).sum(),
    }
