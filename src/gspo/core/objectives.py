"""Policy objectives as pure tensor functions: GSPO, GSPO-token and GRPO (arXiv 2507.18071).

``policy_loss(objective, logp, old_logp, advantages, mask)`` on a padded (B, T) batch, or with
``segment_ids=`` and ``num_segments=`` on a packed (N,) stream, returns ``(loss, metrics)``. The math is
written once, on the packed stream; docs/objectives.md has the formulas, aggregations, metrics and the
deliberate departures from the paper (a clamp on log-ratios before exp, a select for the clipped min).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

PAPER_CLIP = {"gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "grpo": (0.2, 0.27)}
"""The paper's clip range (eps_low, eps_high) per objective (GSPO paper, section 5.1): the defaults."""
AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum")
LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to +-20 before exp: a finite loss and gradient for any input."""

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


@dataclass(frozen=True)
class _Stream:
    """What every objective reads, on a packed stream of N tokens in S segments (detached where noted)."""

    valid: Tensor  # (N,) bool, the token belongs to a segment
    lp: Tensor  # (N,) logp, 0 off-segment, with grad
    log_ratio: Tensor  # (N,) logp - old_logp, 0 off-segment
    seq_log_ratio: Tensor  # (S,) (1/|y_i|) sum_t log r_t, from the (possibly rank-reduced) sums
    adv_seq: Tensor | None  # (S,) per-sequence advantages, 0 for empty sequences; None if per token
    adv_token: Tensor  # (N,) every token's advantage, 0 off-segment
    per_token: Callable[[Tensor], Tensor]  # (S,) -> (N,), zero off-segment


@dataclass(frozen=True)
class _Terms:
    """An objective's loss terms: per sequence (S,) or per token (N,), and where clipping zeroes the
    gradient ("low": A < 0 and ratio < 1 - eps_low; "high": A > 0 and ratio > 1 + eps_high)."""

    level: str  # "sequence" or "token"
    loss: Tensor
    low: Tensor
    high: Tensor
    ratio: Tensor


def _clipped_surrogate(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float):
    """-min(ratio A, clip(ratio, 1-eps_low, 1+eps_high) A) and where clipping zeroes the gradient."""
    high = (adv > 0) & (ratio > 1 + eps_high)
    low = (adv < 0) & (ratio < 1 - eps_low)
    # the clipped branch is a constant: select it rather than take min(), so the gradient is explicit
    clipped_value = ratio.detach().clamp(1 - eps_low, 1 + eps_high) * adv
    return -torch.where(high | low, clipped_value, ratio * adv), low, high


def _exp(x: Tensor) -> Tensor:
    return torch.exp(x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _gspo(s: _Stream, eps_low: float, eps_high: float) -> _Terms:
    """GSPO, Eq. 5-7: s_i = exp((1/|y_i|) sum_t log r_t); L_i = -min(s_i A_i, clip(s_i) A_i)."""
    if s.adv_seq is None:
        raise ValueError("GSPO takes one advantage per sequence; use objective gspo_token for per-token ones")
    seq_ratio = _exp(s.seq_log_ratio)  # (S,)
    return _Terms("sequence", *_clipped_surrogate(seq_ratio, s.adv_seq, eps_low, eps_high), seq_ratio)


def _gspo_token(s: _Stream, eps_low: float, eps_high: float) -> _Terms:
    """GSPO-token, Eq. 13-14: s_i,t = sg[s_i] exp(logp_t - sg[logp_t]); L_t = -min(s_i,t A_t, clip(s_i,t) A_t)."""
    ratio = _exp(s.per_token(s.seq_log_ratio.detach()) + s.lp - s.lp.detach())  # (N,)
    return _Terms("token", *_clipped_surrogate(ratio, s.adv_token, eps_low, eps_high), ratio)


def _grpo(s: _Stream, eps_low: float, eps_high: float) -> _Terms:
    """GRPO, Eq. 2: r_t = exp(logp_t - old_logp_t); L_t = -min(r_t A_t, clip(r_t) A_t)."""
    ratio = _exp(s.log_ratio)  # (N,)
    return _Terms("token", *_clipped_surrogate(ratio, s.adv_token, eps_low, eps_high), ratio)


_TERMS = {"gspo": _gspo, "gspo_token": _gspo_token, "grpo": _grpo}
OBJECTIVES = tuple(_TERMS)


def _check_finite(name: str, checks: list[tuple[str, Tensor, Tensor, str]], segment_ids: Tensor | None = None, num_segments: int = 0) -> None:  # fmt: skip
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
    eps_low: float,
    eps_high: float,
    aggregation: str,
    normalizer: float | Tensor | None,
    ref_logp: Tensor | None,
    beta: float,
    segment_sum_reduce: Callable[[Tensor], Tensor] | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Every objective on a packed stream of N tokens and S segments: shared pieces, its terms, aggregation."""
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

    adv = advantages.detach().to(dtype)
    if per_token_adv:
        adv_seq, adv_token = None, torch.where(valid, adv, 0.0)  # (N,)
    else:
        adv_seq = torch.where(nonempty, adv, 0.0)  # (S,)
        adv_token = per_token(adv_seq)  # (N,)
    stream = _Stream(valid, lp, log_ratio, seq_log_ratio, adv_seq, adv_token, per_token)
    terms = _TERMS[objective](stream, eps_low, eps_high)

    # loss = sum_t w_t L_t / normalizer, with w_t = 1/|y_i| for "seq-mean-token-mean"   (N,)
    if aggregation == "seq-mean-token-mean":
        token_weight = torch.where(valid, 1.0 / per_token(count).clamp_min(1), 0.0)
    else:
        token_weight = valid.to(dtype)
    if normalizer is None:
        normalizer = count.sum().clamp_min(1) if aggregation == "token-mean" else max(S, 1)
    if terms.level == "sequence":
        # a rank weighs L_i by its share of the tokens of i; a token is clipped when its sequence is
        policy_sum = (segment_sum(token_weight) * terms.loss).sum()
        token_low, token_high = per_token(terms.low.to(dtype)) > 0, per_token(terms.high.to(dtype)) > 0
    else:
        policy_sum = (token_weight * terms.loss).sum()
        token_low, token_high = terms.low, terms.high
    policy_loss = policy_sum / normalizer
    loss = policy_loss

    metrics: dict[str, Tensor] = {"loss": policy_loss}
    if ref_logp is not None:
        ref = torch.where(valid, ref_logp.detach().to(dtype), 0.0)  # (N,)
        # kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1   (N,), k3 estimator
        delta = (ref - lp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        kl = (token_weight * (torch.exp(delta) - delta - 1)).sum() / normalizer
        loss = loss + beta * kl
        metrics["kl"] = kl

    with torch.no_grad():
        # per-sequence clipped-token fractions (S,), averaged over the sequences present
        if terms.level == "sequence":  # clipped as a whole; the reduced sums make this global
            seq_present, seq_frac_low, seq_frac_high = nonempty, terms.low.to(dtype), terms.high.to(dtype)
        else:
            seq_present = local_count > 0
            seq_frac_low = segment_sum(token_low.to(dtype)) / local_count.clamp_min(1)
            seq_frac_high = segment_sum(token_high.to(dtype)) / local_count.clamp_min(1)
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
        metrics |= _stats(_exp(seq_log_ratio), nonempty, "ratio_seq")
        metrics |= _stats(_exp(log_ratio), valid, "ratio_token")
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
    aggregation: str = "seq-mean-token-mean",
    normalizer: float | Tensor | None = None,
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
    check_finite: bool = True,
    segment_sum_reduce: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped policy loss of ``objective`` ("gspo", "gspo_token" or "grpo") and its metrics.

    Padded: logp, old_logp, mask, ref_logp (B, T), mask bool (True on completion tokens); advantages (B,)
    per sequence or (B, T) per token (gspo_token, grpo). Packed: logp, old_logp, segment_ids, ref_logp
    (N,), segment_ids long (0..S-1 on completion tokens, -1 elsewhere), num_segments S; advantages (S,) or
    (N,). Tokens outside the mask / segments may hold anything, even NaN: they get zero gradient.
    ``old_logp`` is a constant; on-policy callers pass ``logp.detach()`` (ratio 1, gradient not zero).

    eps_low, eps_high: the clip range [1 - eps_low, 1 + eps_high]; None takes ``PAPER_CLIP[objective]``.
    aggregation: "seq-mean-token-mean" (the paper's 1/G per sequence), "token-mean" or
    "seq-mean-token-sum"; normalizer: the outer denominator (default: B, or the valid token count for
    token-mean); pass the whole batch's when it is split into minibatches, so accumulation is exact.
    ref_logp, beta: a k3 KL term to a reference policy, ``loss = policy_loss + beta * kl``.
    check_finite: raise ValueError on NaN/inf at a valid position (one host sync).
    segment_sum_reduce (packed): a differentiable all-reduce of the (2, S) per-segment sums for sequences
    split across ranks; the ranks' losses and gradients then sum to the unsplit ones.

    Returns (loss, metrics): a scalar to minimise and detached 0-d float32 tensors (docs/objectives.md).
    """
    name = f"policy_loss({objective})"
    if objective not in _TERMS:
        raise ValueError(f"policy_loss: unknown objective {objective!r}; choose one of {OBJECTIVES}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"{name}: unknown aggregation {aggregation!r}; choose one of {AGGREGATIONS}")
    if isinstance(normalizer, (int, float)) and normalizer <= 0:
        raise ValueError(f"{name}: normalizer must be positive, got {normalizer}")
    default_low, default_high = PAPER_CLIP[objective]
    kwargs = dict(
        eps_low=default_low if eps_low is None else eps_low,
        eps_high=default_high if eps_high is None else eps_high,
        aggregation=aggregation, normalizer=normalizer, beta=beta,
    )  # fmt: skip
    if (mask is None) == (segment_ids is None):
        raise ValueError(f"{name}: pass either mask (padded) or segment_ids and num_segments (packed)")
    if mask is not None:
        if segment_sum_reduce is not None:
            raise ValueError(f"{name}: segment_sum_reduce needs the packed form (segment_ids)")
        return _padded(objective, name, logp, old_logp, advantages, mask, check_finite, ref_logp, kwargs)
    if num_segments is None:
        raise ValueError(f"{name}: segment_ids needs num_segments")
    return _packed(
        objective, name, logp, old_logp, advantages, segment_ids, num_segments, check_finite, ref_logp,
        segment_sum_reduce, kwargs,
    )  # fmt: skip


def _padded(objective, name, logp, old_logp, advantages, mask, check_finite, ref_logp, kwargs):
    """Flatten a padded batch into the packed form: segment id = row where mask, else -1."""
    if logp.dim() != 2 or logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(
            f"{name}: logp, old_logp and mask must share one (B, T) shape, got "
            f"{tuple(logp.shape)}, {tuple(old_logp.shape)}, {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool:
        raise ValueError(f"{name}: mask must be bool, got {mask.dtype}")
    if ref_logp is not None and ref_logp.shape != logp.shape:
        raise ValueError(f"{name}: ref_logp shape {tuple(ref_logp.shape)} != logp {tuple(logp.shape)}")
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
        objective, logp.reshape(-1), old_logp.reshape(-1), advantages.reshape(-1) if per_token_adv else advantages,
        segment_ids, B, per_token_adv, ref_logp=None if ref_logp is None else ref_logp.reshape(-1),
        segment_sum_reduce=None, **kwargs,
    )  # fmt: skip


def _packed(objective, name, logp, old_logp, advantages, segment_ids, num_segments, check_finite, ref_logp, reduce, kwargs):  # fmt: skip
    N = logp.shape[0]
    if logp.dim() != 1 or old_logp.shape != (N,) or segment_ids.shape != (N,):
        raise ValueError(
            f"{name}: logp, old_logp and segment_ids must share one (N,) shape, got "
            f"{tuple(logp.shape)}, {tuple(old_logp.shape)}, {tuple(segment_ids.shape)}"
        )
    if segment_ids.dtype != torch.long:
        raise ValueError(f"{name}: segment_ids must be torch.long, got {segment_ids.dtype}")
    if ref_logp is not None and ref_logp.shape != (N,):
        raise ValueError(f"{name}: ref_logp shape {tuple(ref_logp.shape)} != logp {tuple(logp.shape)}")
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
        objective, logp, old_logp, advantages, segment_ids, num_segments, per_token_adv,
        ref_logp=ref_logp, segment_sum_reduce=reduce, **kwargs,
    )  # fmt: skip
