"""Policy objectives as pure tensor functions: the GSPO family (arXiv 2507.18071) and its relatives.

``policy_loss(objective, logp, old_logp, advantages, mask)`` on a padded (B, T) batch, or with
``segment_ids=`` and ``num_segments=`` on a packed (N,) stream, returns ``(loss, metrics)``. Objectives:
GSPO, GSPO-token and GRPO (the GSPO paper), GMPO (arXiv 2507.20673), SAPO at token and sequence level
(arXiv 2511.20347) and CISPO (MiniMax-M1, arXiv 2506.13585); Dr. GRPO and LUSPO are aggregations. Optional
train-inference mismatch corrections (gspo.core.corrections) weigh the policy term. The math is written once,
on the packed stream; docs/objectives.md has the formulas, aggregations, metrics and every deliberate
departure from the papers (a clamp on log-ratios before exp, a select for the clipped min).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from gspo.core.corrections import check_corrections, correction_weights
from gspo.core.surrogates import (
    LOG_RATIO_CLAMP,
    OBJECTIVES,
    PAPER_CLIP,
    PAPER_DEFAULTS,
    SEQUENCE_OBJECTIVES,
    TERMS,
    Stream,
    exp_clamped,
    objective_params,
)

__all__ = ["AGGREGATIONS", "OBJECTIVES", "PAPER_CLIP", "PAPER_DEFAULTS", "policy_loss"]

AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
_LOGP_HINT = (
    "log-probs must be finite on completion tokens: -inf means the token had zero probability (a sampler "
    "top-k/top-p mismatch, or a dtype overflow in the logits), NaN a diverged model or corrupt input"
)
_HINTS = {
    "logp": _LOGP_HINT,
    "old_logp": _LOGP_HINT,
    "ref_logp": _LOGP_HINT,
    "advantages": "advantages must be finite; check the rewards and the advantage normalisation",
}


def _check_finite(
    name: str,
    checks: list[tuple[str, Tensor, Tensor, str]],
    segment_ids: Tensor | None = None,
    num_segments: int = 0,
) -> None:
    """Raise ValueError naming the first non-finite value at a valid position. The only host sync.

    ``checks``: (tensor name, tensor, valid mask of the same shape, unit) with unit "row" (padded, position
    printed as (row r[, col c])), "index" or "segment" (packed).
    """
    bad = [(key, t, valid & ~torch.isfinite(t), unit) for key, t, valid, unit in checks]
    flags = [b.any() for _, _, b, _ in bad]
    if segment_ids is not None:
        out_of_range = segment_ids >= num_segments
        flags.append(out_of_range.any())
    if not torch.stack(flags).any():  # one sync for all checks
        return
    for key, t, b, unit in bad:
        if b.any():
            pos = b.nonzero()[0].tolist()
            value = t[tuple(pos)].item()
            if unit == "row":
                where = f"(row {pos[0]}, col {pos[1]})" if len(pos) == 2 else f"(row {pos[0]})"
            else:
                where = f"{unit} {pos[0]}"
            raise ValueError(
                f"{name}: {key} is {value} at valid position {where} ({int(b.sum())} bad in all). "
                f"Hint: {_HINTS[key]}. Values outside the mask/segments may be anything; "
                f"check_finite=False skips this check."
            )
    idx = out_of_range.nonzero()[0, 0].item()
    raise ValueError(
        f"{name}: segment_ids[{idx}] = {segment_ids[idx].item()} is out of range for "
        f"num_segments={num_segments}. Hint: number segments 0..num_segments-1, -1 for no segment."
    )


def _stats(x: Tensor, mask: Tensor, prefix: str) -> dict[str, Tensor]:
    """{prefix}_mean, _min, _max of x where mask, detached; zeros when the mask is empty."""
    x, n = x.detach(), mask.sum()
    mean = torch.where(mask, x, 0.0).sum() / n.clamp_min(1)
    if x.numel() == 0:
        lo = hi = x.new_zeros(())
    else:
        lo = torch.where(n > 0, torch.where(mask, x, float("inf")).amin(), 0.0)
        hi = torch.where(n > 0, torch.where(mask, x, float("-inf")).amax(), 0.0)
    return {f"{prefix}_mean": mean, f"{prefix}_min": lo, f"{prefix}_max": hi}


def _packed_loss(
    objective: str,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    segment_ids: Tensor,
    num_segments: int,
    per_token_adv: bool,
    *,
    params: Mapping[str, float],
    aggregation: str,
    normalizer: float | Tensor | None,
    ref_logp: Tensor | None,
    beta: float,
    sampler_logp: Tensor | None,
    correction: str | None,
    correction_bounds: tuple[float | None, float | None],
    opsm_delta: float | None,
    segment_sum_reduce: Callable[[Tensor], Tensor] | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Every objective on a packed stream of N tokens and S segments: shared pieces, its terms, the
    mismatch corrections, aggregation and metrics."""
    S = num_segments
    dtype = torch.promote_types(logp.dtype, torch.float32)
    valid = segment_ids >= 0  # (N,)
    bucket = torch.where(valid, segment_ids, S)  # (N,) tokens without a segment go to a spare bucket S

    def segment_sum(x: Tensor) -> Tensor:  # (N,) -> (S,)
        return x.new_zeros(S + 1).index_add(0, bucket, x)[:S]

    def per_token(x: Tensor) -> Tensor:  # (S,) -> (N,), zero off-segment
        return torch.cat([x, x.new_zeros(1)])[bucket]

    # select before any arithmetic: off-segment values (maybe NaN) then get exactly zero gradient
    lp = torch.where(valid, logp.to(dtype), 0.0)  # (N,)
    olp = torch.where(valid, old_logp.detach().to(dtype), 0.0)  # (N,)
    # log r_t = logp_t - old_logp_t   (N,)
    log_ratio = lp - olp
    local_count = segment_sum(valid.to(dtype))  # (S,) this rank's |y_i|
    # sequence parallelism: the (2, S) sums of log-ratios and counts are reduced over the ranks that
    # share segments before any ratio is formed (the design of Fast-LLM's GSPO loss)
    sums = torch.stack([segment_sum(log_ratio), local_count])  # (2, S)
    if segment_sum_reduce is not None:
        sums = segment_sum_reduce(sums)
    count = sums[1].detach()  # (S,) global |y_i|
    nonempty = count > 0
    # log s_i = (1/|y_i|) sum_t log r_t   (S,)
    seq_log_ratio = sums[0] / count.clamp_min(1)

    def segment_mean(x: Tensor) -> Tensor:  # (N,) -> (S,); this rank's tokens (no reduce: checked)
        return segment_sum(x) / count.clamp_min(1)

    adv = advantages.detach().to(dtype)
    if per_token_adv:
        adv_seq, adv_token = None, torch.where(valid, adv, 0.0)  # (N,)
    else:
        adv_seq = torch.where(nonempty, adv, 0.0)  # (S,)
        adv_token = per_token(adv_seq)  # (N,)
    stream = Stream(valid, lp, log_ratio, seq_log_ratio, adv_seq, adv_token, per_token, segment_mean)
    terms = TERMS[objective](stream, params)

    # loss = sum_t w_t c_t L_t / normalizer, w_t = 1/|y_i| for "seq-mean-token-mean", c_t the corrections
    if aggregation == "seq-mean-token-mean":
        token_weight = torch.where(valid, 1.0 / per_token(count).clamp_min(1), 0.0)
    else:
        token_weight = valid.to(dtype)
    if normalizer is None:
        normalizer = count.sum().clamp_min(1) if aggregation == "token-mean" else max(S, 1)
    metrics: dict[str, Tensor] = {}
    weight = None  # (S,) or (N,), the corrections' weight of each term
    if correction is not None or opsm_delta is not None:
        weight, metrics = correction_weights(
            terms.level,
            lp,
            olp,
            sampler_logp,
            valid,
            count,
            adv_seq,
            adv_token,
            segment_sum,
            per_token,
            correction,
            correction_bounds,
            opsm_delta,
            dtype,
        )
    term_loss = terms.loss if weight is None else weight * terms.loss
    if terms.level == "sequence":
        # a rank weighs L_i by its share of the tokens of i
        policy_sum = (segment_sum(token_weight) * term_loss).sum()
    else:
        policy_sum = (token_weight * term_loss).sum()
    if (terms.cut_level or terms.level) == "sequence":  # a token is clipped when its sequence is
        token_low, token_high = per_token(terms.low.to(dtype)) > 0, per_token(terms.high.to(dtype)) > 0
    else:
        token_low, token_high = terms.low, terms.high
    policy_loss = policy_sum / normalizer
    loss = policy_loss

    metrics["loss"] = policy_loss
    if ref_logp is not None:
        ref = torch.where(valid, ref_logp.detach().to(dtype), 0.0)  # (N,)
        # kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1   (N,), k3 estimator
        delta = (ref - lp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        kl = (token_weight * (torch.exp(delta) - delta - 1)).sum() / normalizer
        loss = loss + beta * kl
        metrics["kl"] = kl

    with torch.no_grad():
        # per-sequence clipped-token fractions (S,), averaged over the sequences present
        if (terms.cut_level or terms.level) == "sequence":  # clipped as a whole; global with reduced sums
            seq_present, seq_frac_low, seq_frac_high = nonempty, terms.low.to(dtype), terms.high.to(dtype)
        else:
            seq_present = local_count > 0
            seq_frac_low = segment_sum((token_low & valid).to(dtype)) / local_count.clamp_min(1)
            seq_frac_high = segment_sum((token_high & valid).to(dtype)) / local_count.clamp_min(1)
        if per_token_adv:
            seq_nonzero_adv = segment_sum((adv_token != 0).to(dtype)) > 0
        else:
            seq_nonzero_adv = nonempty & (adv_seq != 0)
        token_low, token_high = token_low & valid, token_high & valid
        num_tokens = valid.sum().to(dtype)
        num_present = seq_present.sum().clamp_min(1)
        metrics |= {
            "clip_frac_token": (token_low | token_high).sum() / num_tokens.clamp_min(1),
            "clip_frac_token_low": token_low.sum() / num_tokens.clamp_min(1),
            "clip_frac_token_high": token_high.sum() / num_tokens.clamp_min(1),
            "clip_frac_seq": torch.where(seq_present, seq_frac_low + seq_frac_high, 0.0).sum() / num_present,
            "clip_frac_seq_low": torch.where(seq_present, seq_frac_low, 0.0).sum() / num_present,
            "clip_frac_seq_high": torch.where(seq_present, seq_frac_high, 0.0).sum() / num_present,
        }
        metrics |= _stats(exp_clamped(seq_log_ratio), nonempty, "ratio_seq")
        metrics |= _stats(exp_clamped(log_ratio), valid, "ratio_token")
        metrics["log_ratio_abs_mean"] = log_ratio.abs().sum() / num_tokens.clamp_min(1)  # zero off-segment
        metrics["num_seq_nonzero_adv"] = seq_nonzero_adv.sum()
        metrics["num_sequences"] = nonempty.sum()
        metrics["num_tokens"] = num_tokens
    return loss, {k: v.detach().to(torch.float32) for k, v in metrics.items()}


def policy_loss(
    objective: str,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor | None = None,
    *,
    segment_ids: Tensor | None = None,
    num_segments: int | None = None,
    eps_low: float | None = None,
    eps_high: float | None = None,
    tau_pos: float | None = None,
    tau_neg: float | None = None,
    aggregation: str = "seq-mean-token-mean",
    normalizer: float | Tensor | None = None,
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
    sampler_logp: Tensor | None = None,
    correction: str | None = None,
    correction_bounds: tuple[float | None, float | None] | None = None,
    opsm_delta: float | None = None,
    check_finite: bool = True,
    segment_sum_reduce: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy loss of ``objective`` (one of ``OBJECTIVES``) and its metrics.

    Padded: logp, old_logp, mask, ref_logp, sampler_logp (B, T), mask bool (True on completion tokens);
    advantages (B,) per sequence or (B, T) per token (not for the sequence objectives gspo, gmpo, sapo_seq).
    Packed: the same as (N,), with segment_ids long (0..S-1 on completion tokens, -1 elsewhere) and
    num_segments S; advantages (S,) or (N,). Tokens outside the mask / segments may hold anything, even NaN:
    they get zero gradient. ``old_logp`` is a constant; on-policy callers pass ``logp.detach()`` (ratio 1,
    gradient not zero).

    eps_low, eps_high: the clip range [1 - eps_low, 1 + eps_high] (GMPO: [-eps_low, eps_high] on log r_t;
    CISPO: the range of its detached weight); tau_pos, tau_neg: SAPO's gate temperatures. None takes the
    objective's ``PAPER_DEFAULTS``; a knob the objective does not have is an error.
    aggregation: "seq-mean-token-mean" (the paper's 1/G per sequence), "token-mean", "seq-mean-token-sum"
    (LUSPO with gspo) or "seq-mean-token-sum-norm" (Dr. GRPO: needs ``normalizer`` = B x a constant token
    count); normalizer: the outer denominator (default: B, or the valid token count for token-mean); pass the
    whole batch's when it is split into minibatches, so accumulation is exact.
    ref_logp, beta: a k3 KL term to a reference policy, ``loss = policy_loss + beta * kl``.
    sampler_logp: the log-probs of the engine that sampled (NaN where unknown); correction: one of
    ``gspo.core.corrections.CORRECTIONS`` ("token_truncate", "token_mask", "sequence_truncate",
    "sequence_mask") with correction_bounds (C_min, C_max) (None: its default); opsm_delta: off-policy
    sequence masking's threshold (None: off), measured against sampler_logp, or old_logp without it.
    check_finite: raise ValueError on NaN/inf at a valid position (one host sync).
    segment_sum_reduce (packed): a differentiable all-reduce of the (2, S) per-segment sums for sequences
    split across ranks; the ranks' losses and gradients then sum to the unsplit ones.

    Returns (loss, metrics): a scalar to minimise and detached 0-d float32 tensors (docs/objectives.md).
    """
    name = f"policy_loss({objective})"
    params = objective_params(objective, eps_low=eps_low, eps_high=eps_high, tau_pos=tau_pos, tau_neg=tau_neg)
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"{name}: unknown aggregation {aggregation!r}; choose one of {AGGREGATIONS}")
    if aggregation == "seq-mean-token-sum-norm" and normalizer is None:
        raise ValueError(
            f"{name}: aggregation seq-mean-token-sum-norm (Dr. GRPO) divides by a constant: pass "
            "normalizer = number of sequences x the maximum completion length"
        )
    if isinstance(normalizer, (int, float)) and normalizer <= 0:
        raise ValueError(f"{name}: normalizer must be positive, got {normalizer}")
    bounds = check_corrections(
        name, objective, sampler_logp, correction, correction_bounds, opsm_delta, SEQUENCE_OBJECTIVES
    )
    if segment_sum_reduce is not None and (
        objective == "gmpo" or bounds is not None or opsm_delta is not None
    ):
        raise ValueError(
            f"{name}: segment_sum_reduce (sequences split across ranks) supports neither gmpo nor the "
            "mismatch corrections: their per-sequence means would need further all-reduces"
        )
    kwargs = dict(
        params=params,
        aggregation=aggregation,
        normalizer=normalizer,
        beta=beta,
        correction=correction,
        correction_bounds=bounds,
        opsm_delta=opsm_delta,
    )
    if (mask is None) == (segment_ids is None):
        raise ValueError(f"{name}: pass either mask (padded) or segment_ids and num_segments (packed)")
    if mask is not None:
        if segment_sum_reduce is not None:
            raise ValueError(f"{name}: segment_sum_reduce needs the packed form (segment_ids)")
        return _padded(
            objective, name, logp, old_logp, advantages, mask, check_finite, ref_logp, sampler_logp, kwargs
        )
    if num_segments is None:
        raise ValueError(f"{name}: segment_ids needs num_segments")
    return _packed(
        objective,
        name,
        logp,
        old_logp,
        advantages,
        segment_ids,
        num_segments,
        check_finite,
        ref_logp,
        sampler_logp,
        segment_sum_reduce,
        kwargs,
    )


def _padded(objective, name, logp, old_logp, advantages, mask, check_finite, ref_logp, sampler_logp, kwargs):
    """Flatten a padded batch into the packed form: segment id = row where mask, else -1."""
    if logp.dim() != 2 or logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(
            f"{name}: logp, old_logp and mask must share one (B, T) shape, got "
            f"{tuple(logp.shape)}, {tuple(old_logp.shape)}, {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool:
        raise ValueError(f"{name}: mask must be bool, got {mask.dtype}")
    for key, x in (("ref_logp", ref_logp), ("sampler_logp", sampler_logp)):
        if x is not None and x.shape != logp.shape:
            raise ValueError(f"{name}: {key} shape {tuple(x.shape)} != logp {tuple(logp.shape)}")
    B, T = logp.shape
    per_token_adv = advantages.dim() == 2
    if advantages.shape not in ((B,), (B, T)):
        raise ValueError(f"{name}: advantages must be ({B},) or ({B}, {T}), got {tuple(advantages.shape)}")
    if check_finite:
        checks = [("logp", logp.detach(), mask, "row"), ("old_logp", old_logp.detach(), mask, "row")]
        checks.append(("advantages", advantages.detach(), mask if per_token_adv else mask.any(1), "row"))
        if ref_logp is not None:
            checks.append(("ref_logp", ref_logp.detach(), mask, "row"))
        _check_finite(name, checks)
    rows = torch.arange(B, device=logp.device).unsqueeze(1).expand(B, T)
    segment_ids = torch.where(mask, rows, -1).reshape(-1)
    return _packed_loss(
        objective,
        logp.reshape(-1),
        old_logp.reshape(-1),
        advantages.reshape(-1) if per_token_adv else advantages,
        segment_ids,
        B,
        per_token_adv,
        ref_logp=None if ref_logp is None else ref_logp.reshape(-1),
        sampler_logp=None if sampler_logp is None else sampler_logp.reshape(-1),
        segment_sum_reduce=None,
        **kwargs,
    )


def _packed(
    objective,
    name,
    logp,
    old_logp,
    advantages,
    segment_ids,
    num_segments,
    check_finite,
    ref_logp,
    sampler_logp,
    reduce,
    kwargs,
):
    N = logp.shape[0]
    if logp.dim() != 1 or old_logp.shape != (N,) or segment_ids.shape != (N,):
        raise ValueError(
            f"{name}: logp, old_logp and segment_ids must share one (N,) shape, got "
            f"{tuple(logp.shape)}, {tuple(old_logp.shape)}, {tuple(segment_ids.shape)}"
        )
    if segment_ids.dtype != torch.long:
        raise ValueError(f"{name}: segment_ids must be torch.long, got {segment_ids.dtype}")
    for key, x in (("ref_logp", ref_logp), ("sampler_logp", sampler_logp)):
        if x is not None and x.shape != (N,):
            raise ValueError(f"{name}: {key} shape {tuple(x.shape)} != logp {tuple(logp.shape)}")
    # (num_segments,) is per segment, even in the rare case N == num_segments
    per_token_adv = advantages.shape != (num_segments,)
    if per_token_adv and advantages.shape != (N,):
        raise ValueError(
            f"{name}: advantages must be ({num_segments},) per segment or ({N},) per token, "
            f"got {tuple(advantages.shape)}"
        )
    if check_finite:
        valid = segment_ids >= 0
        if per_token_adv:
            adv_check = ("advantages", advantages.detach(), valid, "index")
        else:
            present = torch.zeros(num_segments + 1, dtype=torch.bool, device=valid.device)
            present[torch.where(valid, segment_ids, num_segments).clamp_max(num_segments)] = True
            adv_check = ("advantages", advantages.detach(), present[:num_segments], "segment")
        checks = [("logp", logp.detach(), valid, "index"), ("old_logp", old_logp.detach(), valid, "index")]
        checks.append(adv_check)
        if ref_logp is not None:
            checks.append(("ref_logp", ref_logp.detach(), valid, "index"))
        _check_finite(name, checks, segment_ids, num_segments)
    return _packed_loss(
        objective,
        logp,
        old_logp,
        advantages,
        segment_ids,
        num_segments,
        per_token_adv,
        ref_logp=ref_logp,
        sampler_logp=sampler_logp,
        segment_sum_reduce=reduce,
        **kwargs,
    )
