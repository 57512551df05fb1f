"""GSPO, GSPO-token and GRPO objectives as pure tensor functions (arXiv 2507.18071).

Every objective takes the log-probs of the sampled completion tokens under the current policy (``logp``,
with grad) and under the behaviour policy that sampled them (``old_logp``, treated as a constant), the
advantages, and either a padded ``mask`` (B, T) or a packed stream with ``segment_ids`` (N,). It returns
``(loss, metrics)``: a scalar to minimise and a dict of detached 0-d float tensors. On-policy callers pass
``old_logp = logp.detach()``: the ratio is then 1 in value but its gradient is not zero.

The math lives once, on the packed stream; the padded functions flatten (segment id = row where the mask
is set, else -1) and call it. Per-segment sums use ``index_add``, with no Python loop over segments. All
arithmetic runs in float32 (float64 inputs stay float64); bf16 inputs get bf16 gradients.

Objectives (L is a loss, the negated surrogate; clip(x) = clip(x, 1 - eps_low, 1 + eps_high)):
  GRPO (Eq. 2)          r_t = exp(logp_t - old_logp_t);  L_t = -min(r_t A_t, clip(r_t) A_t)
  GSPO (Eq. 5-7)        s_i = exp((1/|y_i|) sum_t (logp_t - old_logp_t));  L_i = -min(s_i A_i, clip(s_i) A_i)
  GSPO-token (Eq. 13-14) s_i,t = sg[s_i] exp(logp_t - sg[logp_t]);  L_t = -min(s_i,t A_i,t, clip(s_i,t) A_i,t)
GSPO-token has GSPO's value and gradient when A_i,t = A_i (as the paper shows); it exists to allow
per-token advantages. GRPO also accepts per-token advantages.

Arguments, common to all six functions:
  logp        (B, T) padded or (N,) packed: log-probs of the sampled tokens under the current policy, with
              grad, any float dtype (the math runs in float32; the gradient comes back in logp's dtype).
  old_logp    same shape: log-probs under the behaviour policy that sampled the tokens (a constant).
  advantages  (B,) or (num_segments,) per sequence; gspo_token and grpo also take (B, T) or (N,) per
              token (in the packed form, 1-D advantages of length num_segments are read as per segment,
              even when N == num_segments).
  mask        (B, T) bool, True on completion tokens; or segment_ids (N,) long, 0..num_segments-1 on
              completion tokens, negative (-1) on prompt/padding tokens, plus num_segments = S. Tokens
              outside the mask / segments may hold anything, even NaN.
  eps_low, eps_high  the clip range [1 - eps_low, 1 + eps_high].
  aggregation, normalizer  see below.
  ref_logp, beta     optional KL term, see below.
  check_finite       raise ValueError on NaN/inf at a valid position of any input (one host sync).

Aggregations (``aggregation=``), written for a token-level term L_t; for GSPO put L_t = L_i on each token:
  "seq-mean-token-mean"  (1/B) sum_i (1/|y_i|) sum_t L_t   the papers' 1/G: every sequence weighs the same,
                          whatever its length. For GSPO this is (1/B) sum_i L_i.
  "token-mean"           sum_i sum_t L_t / sum_i |y_i|     length-weighted: a sequence weighs by its token
                          count. For GSPO: sum_i |y_i| L_i / sum_i |y_i| (TRL's default "dapo" loss).
  "seq-mean-token-sum"   (1/B) sum_i sum_t L_t             like token-mean but over a fixed B; for GSPO
                          (1/B) sum_i |y_i| L_i.
``normalizer`` is the outer denominator: by default B (``num_segments``, empty sequences included) for
"seq-mean-*" and the number of valid tokens for "token-mean". Pass the whole batch's value when a batch is
split into minibatches: the sum of the minibatch losses (gradient accumulation) then equals the full-batch
loss, and its gradient the full-batch gradient, exactly.

Metrics (detached 0-d float32; a token or sequence counts as clipped when clipping zeroes its gradient:
"high" = A > 0 and ratio > 1 + eps_high, "low" = A < 0 and ratio < 1 - eps_low): "loss" (policy loss,
before KL), "kl" (with ref_logp), "clip_frac_token[_low|_high]" (clipped / valid tokens; a GSPO token is
clipped when its sequence is), "clip_frac_seq[_low|_high]" (mean over non-empty sequences of their
clipped-token fraction; for GSPO clipped / non-empty sequences), "ratio_seq_{mean,min,max}" (s_i over
non-empty sequences, for every objective), "ratio_token_{mean,min,max}" (exp(logp - old_logp) over valid
tokens), "log_ratio_abs_mean", "num_seq_nonzero_adv", "num_sequences" (non-empty ones), "num_tokens".
An empty batch gives zeros, never NaN.

KL (``ref_logp``, ``beta``): k3 estimator kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1, aggregated
like the policy term; ``loss = policy_loss + beta * kl``. Metric "loss" is the policy loss alone.

Sequence parallelism (packed forms, ``segment_sum_reduce``): when one segment's tokens are split across
ranks, each rank passes a differentiable all-reduce (sum) that the functions apply to the stacked
per-segment sums (2, S) = (sum of log-ratios, token counts) before any ratio is formed. Every sequence
term is then weighted by (local tokens)/(global tokens), so the ranks' losses sum to the unsplit loss and
their gradients to the unsplit gradient (the design of Fast-LLM's GSPO loss). Under it, metrics built from
the reduced sums (ratio_seq_*, num_sequences and, for GSPO, clip_frac_seq*) are global; the others
describe the rank's own tokens.

Departures from the paper, all deliberate:
  * A log-ratio (the sequence one for GSPO, the token one for GRPO, the exponent for GSPO-token, and
    ref - logp for the KL) is clamped to [-20, 20] before exp, so log-ratios of +-1e4 give a finite loss
    and gradient; beyond the clamp the gradient through it is zero. The paper has no clamp.
  * -min(x A, clip(x) A) is computed as a select on the clip condition (A > 0 and x > 1 + eps_high, or
    A < 0 and x < 1 - eps_low): same value and gradient, and at the kink itself the unclipped gradient.
  * An empty sequence (no valid token) contributes exactly 0, but still counts in B.
  * Positions outside the mask / segments may hold anything (NaN, inf); they never reach the loss, and
    their gradient is exactly zero. NaN or inf at a valid position raises ValueError (``check_finite``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum")
LOG_RATIO_CLAMP = 20.0

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
    fn_name: str,
    checks: list[tuple[str, Tensor, Tensor, str]],
    segment_ids: Tensor | None = None,
    num_segments: int = 0,
) -> None:
    """Raise ValueError naming the first non-finite value at a valid position. The only host sync.

    ``checks``: (tensor name, tensor, valid mask of the same shape, unit) with unit "row" (padded, position
    printed as (row r[, col c])), "index" or "segment" (packed).
    """
    bad = [(name, t, valid & ~torch.isfinite(t), unit) for name, t, valid, unit in checks]
    flags = [b.any() for _, _, b, _ in bad]
    if segment_ids is not None:
        out_of_range = segment_ids >= num_segments
        flags.append(out_of_range.any())
    if not torch.stack(flags).any():  # one sync for all checks
        return
    for name, t, b, unit in bad:
        if b.any():
            pos = b.nonzero()[0].tolist()
            value = t[tuple(pos)].item()
            if unit == "row":
                where = f"(row {pos[0]}, col {pos[1]})" if len(pos) == 2 else f"(row {pos[0]})"
            else:
                where = f"{unit} {pos[0]}"
            raise ValueError(
                f"{fn_name}: {name} is {value} at valid position {where} ({int(b.sum())} bad in all). "
                f"Hint: {_HINTS[name]}. Values outside the mask/segments may be anything; "
                f"check_finite=False skips this check."
            )
    idx = out_of_range.nonzero()[0, 0].item()
    raise ValueError(
        f"{fn_name}: segment_ids[{idx}] = {segment_ids[idx].item()} is out of range for "
        f"num_segments={num_segments}. Hint: number segments 0..num_segments-1, -1 for no segment."
    )


def _clipped_surrogate(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float):
    """-min(ratio A, clip(ratio, 1-eps_low, 1+eps_high) A) and where clipping zeroes the gradient."""
    high = (adv > 0) & (ratio > 1 + eps_high)
    low = (adv < 0) & (ratio < 1 - eps_low)
    # the clipped branch is a constant: select it rather than take min(), so the gradient is explicit
    clipped_value = ratio.detach().clamp(1 - eps_low, 1 + eps_high) * adv
    return -torch.where(high | low, clipped_value, ratio * adv), low, high


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


def _objective_packed(
    kind: str,
    fn_name: str,
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
    """The one implementation of the three objectives on a packed stream of N tokens and S segments."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"{fn_name}: unknown aggregation {aggregation!r}; choose one of {AGGREGATIONS}")
    if kind == "gspo" and per_token_adv:
        raise ValueError(
            f"{fn_name}: GSPO takes one advantage per sequence; use gspo_token_loss for per-token advantages"
        )
    if isinstance(normalizer, (int, float)) and normalizer <= 0:
        raise ValueError(f"{fn_name}: normalizer must be positive, got {normalizer}")
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
    sums = torch.stack([segment_sum(log_ratio), local_count])  # (2, S)
    if segment_sum_reduce is not None:
        sums = segment_sum_reduce(sums)
    count = sums[1].detach()  # (S,) global |y_i|
    nonempty = count > 0
    # log s_i = (1/|y_i|) sum_t log r_t   (S,)
    seq_log_ratio = sums[0] / count.clamp_min(1)
    # s_i = exp(log s_i)   (S,)
    seq_ratio = torch.exp(seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))

    adv = advantages.detach().to(dtype)
    if per_token_adv:
        adv_token = torch.where(valid, adv, 0.0)  # (N,)
    else:
        adv_seq = torch.where(nonempty, adv, 0.0)  # (S,)
        adv_token = per_token(adv_seq)  # (N,)

    # aggregation: loss = sum_t w_t L_t / normalizer, with w_t = 1/|y_i| for "seq-mean-token-mean"
    if aggregation == "seq-mean-token-mean":
        token_weight = torch.where(valid, 1.0 / per_token(count).clamp_min(1), 0.0)  # (N,)
    else:
        token_weight = valid.to(dtype)  # (N,)
    if normalizer is None:
        normalizer = count.sum().clamp_min(1) if aggregation == "token-mean" else max(S, 1)

    if kind == "gspo":
        # L_i = -min(s_i A_i, clip(s_i) A_i)   (S,); a rank weighs L_i by its share of the tokens of i
        seq_loss, seq_low, seq_high = _clipped_surrogate(seq_ratio, adv_seq, eps_low, eps_high)
        policy_sum = (segment_sum(token_weight) * seq_loss).sum()
        # a token is clipped when its sequence is
        token_low, token_high = per_token(seq_low.to(dtype)) > 0, per_token(seq_high.to(dtype)) > 0
    else:
        # GSPO-token: s_i,t = exp(sg[log s_i] + logp_t - sg[logp_t]);  GRPO: r_t = exp(log r_t)   (N,)
        exponent = per_token(seq_log_ratio.detach()) + lp - lp.detach() if kind == "gspo_token" else log_ratio
        ratio = torch.exp(exponent.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        token_loss, token_low, token_high = _clipped_surrogate(ratio, adv_token, eps_low, eps_high)
        policy_sum = (token_weight * token_loss).sum()
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
        if kind == "gspo":  # a sequence is clipped as a whole; its reduced sums make this global
            seq_present, seq_frac_low, seq_frac_high = nonempty, seq_low.to(dtype), seq_high.to(dtype)
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
        metrics |= _stats(seq_ratio, nonempty, "ratio_seq")
        token_ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        metrics |= _stats(token_ratio, valid, "ratio_token")
        metrics["log_ratio_abs_mean"] = log_ratio.abs().sum() / num_tokens.clamp_min(1)  # zero off-segment
        metrics["num_seq_nonzero_adv"] = seq_nonzero_adv.sum()
        metrics["num_sequences"] = nonempty.sum()
        metrics["num_tokens"] = num_tokens
    return loss, {k: v.detach().to(torch.float32) for k, v in metrics.items()}


def _padded(kind, fn_name, logp, old_logp, advantages, mask, *, check_finite, ref_logp, **kwargs):
    """Flatten a padded batch into the packed form: segment id = row where mask, else -1."""
    if logp.dim() != 2 or logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(
            f"{fn_name}: logp, old_logp and mask must share one (B, T) shape, got "
            f"{tuple(logp.shape)}, {tuple(old_logp.shape)}, {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool:
        raise ValueError(f"{fn_name}: mask must be bool, got {mask.dtype}")
    if ref_logp is not None and ref_logp.shape != logp.shape:
        raise ValueError(f"{fn_name}: ref_logp shape {tuple(ref_logp.shape)} != logp {tuple(logp.shape)}")
    B, T = logp.shape
    per_token_adv = advantages.dim() == 2
    if advantages.shape not in ((B,), (B, T)):
        raise ValueError(f"{fn_name}: advantages must be ({B},) or ({B}, {T}), got {tuple(advantages.shape)}")
    if check_finite:
        checks = [("logp", logp.detach(), mask, "row"), ("old_logp", old_logp.detach(), mask, "row")]
        checks.append(("advantages", advantages.detach(), mask if per_token_adv else mask.any(1), "row"))
        if ref_logp is not None:
            checks.append(("ref_logp", ref_logp.detach(), mask, "row"))
        _check_finite(fn_name, checks)
    rows = torch.arange(B, device=logp.device).unsqueeze(1).expand(B, T)
    segment_ids = torch.where(mask, rows, -1).reshape(-1)
    return _objective_packed(
        kind,
        fn_name,
        logp.reshape(-1),
        old_logp.reshape(-1),
        advantages.reshape(-1) if per_token_adv else advantages,
        segment_ids,
        B,
        per_token_adv,
        ref_logp=None if ref_logp is None else ref_logp.reshape(-1),
        segment_sum_reduce=None,
        **kwargs,
    )


def _packed(
    kind, fn_name, logp, old_logp, advantages, segment_ids, num_segments, *, check_finite, ref_logp, **kwargs
):
    N = logp.shape[0]
    if logp.dim() != 1 or old_logp.shape != (N,) or segment_ids.shape != (N,):
        raise ValueError(
            f"{fn_name}: logp, old_logp and segment_ids must share one (N,) shape, got "
            f"{tuple(logp.shape)}, {tuple(old_logp.shape)}, {tuple(segment_ids.shape)}"
        )
    if segment_ids.dtype != torch.long:
        raise ValueError(f"{fn_name}: segment_ids must be torch.long, got {segment_ids.dtype}")
    if ref_logp is not None and ref_logp.shape != (N,):
        raise ValueError(f"{fn_name}: ref_logp shape {tuple(ref_logp.shape)} != logp {tuple(logp.shape)}")
    # (num_segments,) is per segment, even in the rare case N == num_segments
    per_token_adv = advantages.shape != (num_segments,)
    if per_token_adv and advantages.shape != (N,):
        raise ValueError(
            f"{fn_name}: advantages must be ({num_segments},) per segment or ({N},) per token, "
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
        _check_finite(fn_name, checks, segment_ids, num_segments)
    return _objective_packed(
        kind,
        fn_name,
        logp,
        old_logp,
        advantages,
        segment_ids,
        num_segments,
        per_token_adv,
        ref_logp=ref_logp,
        **kwargs,
    )


def gspo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    aggregation: str = "seq-mean-token-mean",
    normalizer: float | Tensor | None = None,
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
    check_finite: bool = True,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO, paper Eq. 5-7: a sequence-level ratio, clipped per sequence.

    s_i = exp((1/|y_i|) sum_t (logp_i,t - old_logp_i,t)),  L_i = -min(s_i A_i, clip(s_i, 1-eps_low,
    1+eps_high) A_i), loss = (1/B) sum_i L_i with the default aggregation (the paper's 1/G). Departures:
    log s_i clamped to [-20, 20] before exp; an empty sequence contributes 0.

    Shapes: logp, old_logp, mask, ref_logp (B, T); advantages (B,). Arguments and metrics: module docstring.
    Returns (loss, metrics): a scalar to minimise and a dict of detached 0-d float32 tensors.
    """
    return _padded(
        "gspo",
        "gspo_loss",
        logp,
        old_logp,
        advantages,
        mask,
        eps_low=eps_low,
        eps_high=eps_high,
        aggregation=aggregation,
        normalizer=normalizer,
        ref_logp=ref_logp,
        beta=beta,
        check_finite=check_finite,
    )


def gspo_token_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    aggregation: str = "seq-mean-token-mean",
    normalizer: float | Tensor | None = None,
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
    check_finite: bool = True,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO-token, paper Eq. 13-14: GSPO's ratio on every token, clipped per token.

    s_i,t = sg[s_i] exp(logp_i,t - sg[logp_i,t]) (= s_i in value), L_i,t = -min(s_i,t A_i,t,
    clip(s_i,t, 1-eps_low, 1+eps_high) A_i,t), loss = (1/B) sum_i (1/|y_i|) sum_t L_i,t by default.
    With A_i,t = A_i its value and gradient equal GSPO's. Departure: the exponent is clamped to [-20, 20].

    Shapes: logp, old_logp, mask, ref_logp (B, T); advantages (B,) or (B, T). Arguments and metrics:
    module docstring. Returns (loss, metrics) as gspo_loss.
    """
    return _padded(
        "gspo_token",
        "gspo_token_loss",
        logp,
        old_logp,
        advantages,
        mask,
        eps_low=eps_low,
        eps_high=eps_high,
        aggregation=aggregation,
        normalizer=normalizer,
        ref_logp=ref_logp,
        beta=beta,
        check_finite=check_finite,
    )


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.27,
    aggregation: str = "seq-mean-token-mean",
    normalizer: float | Tensor | None = None,
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
    check_finite: bool = True,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO, paper Eq. 2: token-level ratios, clipped per token.

    r_i,t = exp(logp_i,t - old_logp_i,t), L_i,t = -min(r_i,t A_i,t, clip(r_i,t, 1-eps_low, 1+eps_high)
    A_i,t), loss = (1/B) sum_i (1/|y_i|) sum_t L_i,t by default (the paper's 1/G and 1/|y_i|). The paper
    has A_i,t = A_i; per-token advantages are allowed. Departure: log r clamped to [-20, 20] before exp.

    Shapes: logp, old_logp, mask, ref_logp (B, T); advantages (B,) or (B, T). Arguments and metrics:
    module docstring. Returns (loss, metrics) as gspo_loss.
    """
    return _padded(
        "grpo",
        "grpo_loss",
        logp,
        old_logp,
        advantages,
        mask,
        eps_low=eps_low,
        eps_high=eps_high,
        aggregation=aggregation,
        normalizer=normalizer,
        ref_logp=ref_logp,
        beta=beta,
        check_finite=check_finite,
    )


def gspo_loss_packed(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    segment_ids: Tensor,
    num_segments: int,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    aggregation: str = "seq-mean-token-mean",
    normalizer: float | Tensor | None = None,
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
    check_finite: bool = True,
    segment_sum_reduce: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO, paper Eq. 5-7, packed (padding-free): the same loss, metrics and gradients as the padded form.

    s_i = exp(mean over segment i of (logp - old_logp)), L_i = -min(s_i A_i, clip(s_i) A_i);
    aggregation, KL and departures as in the padded function (module docstring).
    Shapes: logp, old_logp, segment_ids, ref_logp (N,); advantages (S,); S = num_segments.
    segment_sum_reduce: for sequence parallelism, a differentiable all-reduce (sum) over the ranks that
    share segments, applied to the (2, S) per-segment sums (sum of log-ratios, token counts); each
    rank's terms are weighted by its share of each segment's tokens, so the ranks' losses and gradients
    sum to the unsplit ones.
    """
    return _packed(
        "gspo",
        "gspo_loss_packed",
        logp,
        old_logp,
        advantages,
        segment_ids,
        num_segments,
        eps_low=eps_low,
        eps_high=eps_high,
        aggregation=aggregation,
        normalizer=normalizer,
        ref_logp=ref_logp,
        beta=beta,
        check_finite=check_finite,
        segment_sum_reduce=segment_sum_reduce,
    )


def gspo_token_loss_packed(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    segment_ids: Tensor,
    num_segments: int,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    aggregation: str = "seq-mean-token-mean",
    normalizer: float | Tensor | None = None,
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
    check_finite: bool = True,
    segment_sum_reduce: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO-token, paper Eq. 13-14, packed (padding-free): same loss, metrics and gradients as padded.

    s_i,t = sg[s_i] exp(logp_t - sg[logp_t]), L_t = -min(s_i,t A_t, clip(s_i,t) A_t);
    aggregation, KL and departures as in the padded function (module docstring).
    Shapes: logp, old_logp, segment_ids, ref_logp (N,); advantages (S,) or (N,); S = num_segments.
    segment_sum_reduce: for sequence parallelism, a differentiable all-reduce (sum) over the ranks that
    share segments, applied to the (2, S) per-segment sums (sum of log-ratios, token counts); each
    rank's terms are weighted by its share of each segment's tokens, so the ranks' losses and gradients
    sum to the unsplit ones.
    """
    return _packed(
        "gspo_token",
        "gspo_token_loss_packed",
        logp,
        old_logp,
        advantages,
        segment_ids,
        num_segments,
        eps_low=eps_low,
        eps_high=eps_high,
        aggregation=aggregation,
        normalizer=normalizer,
        ref_logp=ref_logp,
        beta=beta,
        check_finite=check_finite,
        segment_sum_reduce=segment_sum_reduce,
    )


def grpo_loss_packed(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    segment_ids: Tensor,
    num_segments: int,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.27,
    aggregation: str = "seq-mean-token-mean",
    normalizer: float | Tensor | None = None,
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
    check_finite: bool = True,
    segment_sum_reduce: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO, paper Eq. 2, packed (padding-free): the same loss, metrics and gradients as the padded form.

    r_t = exp(logp_t - old_logp_t), L_t = -min(r_t A_t, clip(r_t) A_t);
    aggregation, KL and departures as in the padded function (module docstring).
    Shapes: logp, old_logp, segment_ids, ref_logp (N,); advantages (S,) or (N,); S = num_segments.
    segment_sum_reduce: for sequence parallelism, a differentiable all-reduce (sum) over the ranks that
    share segments, applied to the (2, S) per-segment sums (sum of log-ratios, token counts); each
    rank's terms are weighted by its share of each segment's tokens, so the ranks' losses and gradients
    sum to the unsplit ones.
    """
    return _packed(
        "grpo",
        "grpo_loss_packed",
        logp,
        old_logp,
        advantages,
        segment_ids,
        num_segments,
        eps_low=eps_low,
        eps_high=eps_high,
        aggregation=aggregation,
        normalizer=normalizer,
        ref_logp=ref_logp,
        beta=beta,
        check_finite=check_finite,
        segment_sum_reduce=segment_sum_reduce,
    )


OBJECTIVES = {"gspo": gspo_loss, "gspo_token": gspo_token_loss, "grpo": grpo_loss}
PACKED_OBJECTIVES = {"gspo": gspo_loss_packed, "gspo_token": gspo_token_loss_packed, "grpo": grpo_loss_packed}
