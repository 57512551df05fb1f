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


def check_corrections(name, objective, sampler_logp, correction, bounds, opsm_delta, sequence_objectives):
    """The correction's (C_min, C_max), None without one; a ValueError naming the fix for a wrong combination."""
    if opsm_delta is not None and not opsm_delta >= 0:
        raise ValueError(f"{name}: opsm_delta must be >= 0 (None disables), got {opsm_delta}")
    if correction is None:
        if bounds is not None:
            raise ValueError(f"{name}: correction_bounds without a correction")
        return None
    if correction not in CORRECTION_BOUNDS:
        raise ValueError(
            f"{name}: unknown correction {correction!r}; choose one of {tuple(CORRECTION_BOUNDS)}"
        )
    if sampler_logp is None:
        raise ValueError(f"{name}: correction {correction!r} needs sampler_logp, the sampler's log-probs")
    if objective in sequence_objectives and correction_level(correction) == "token":
        raise ValueError(
            f"{name}: {correction} weighs tokens, but {objective} has one term per sequence; use "
            f"{correction.replace('token', 'sequence')} (the length-normalised sequence ratio)"
        )
    low, high = CORRECTION_BOUNDS[correction] if bounds is None else bounds
    if (
        (low is not None and low < 0)
        or (high is not None and high <= 0)
        or (None not in (low, high) and low > high)
    ):
        raise ValueError(
            f"{name}: correction_bounds must satisfy 0 <= C_min <= C_max, C_max > 0, got {bounds}"
        )
    return low, high


def correction_weights(
    level,
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
    bounds,
    opsm_delta,
    dtype,
):
    """The mismatch corrections' weight of each term ((S,) for sequence terms, else (N,)) and their metrics.

    A token the sampler gave no log-prob for (NaN) has log rho_t = 0 (ratio 1) and still counts in |y_i|.
    """
    with torch.no_grad():
        nonempty, n_tok, n_seq = count > 0, valid.sum().to(dtype).clamp_min(1), (count > 0).sum().clamp_min(1)

        def fractions(flags: Tensor, per_seq: bool, name: str) -> dict[str, Tensor]:
            """Fractions of tokens and (mean per sequence) of flagged tokens; flags (S,) or (N,)."""
            if per_seq:
                seq = torch.where(nonempty, flags.to(dtype), 0.0)  # (S,)
                tok = per_token(seq)  # (N,)
            else:
                tok = (flags & valid).to(dtype)  # (N,)
                seq = segment_sum(tok) / count.clamp_min(1)  # (S,)
            return {f"{name}_frac_token": tok.sum() / n_tok, f"{name}_frac_seq": seq.sum() / n_seq}

        metrics: dict[str, Tensor] = {}
        weight = torch.ones_like(count if level == "sequence" else lp)
        behaviour = olp if sampler_logp is None else sampler_logp.detach().to(dtype)
        behaviour = torch.where(
            valid & ~torch.isnan(behaviour), behaviour, olp
        )  # (N,) unknown: log rho_t = 0
        if correction is not None:
            per_seq = correction_level(correction) == "sequence"
            # log rho_t = log pi_old - log pi_sampler   (N,);  log rho_i = (1/|y_i|) sum_t log rho_t   (S,)
            log_rho = olp - behaviour
            if per_seq:
                log_rho = segment_sum(log_rho) / count.clamp_min(1)
            w, truncated, masked = importance_weights(log_rho, correction, *bounds)
            weight = weight * (w if level == "sequence" or not per_seq else per_token(w))
            metrics |= fractions(truncated, per_seq, "sampler_is_truncated")
            metrics |= fractions(masked, per_seq, "sampler_is_masked")
            metrics["sampler_is_weight_mean"] = ((per_token(w) if per_seq else w) * valid).sum() / n_tok
        if opsm_delta is not None:
            # KL_i = (1/|y_i|) sum_t (log pi_sampler - log pi_theta)   (S,), the current policy detached
            seq_kl = segment_sum(behaviour - lp.detach()) / count.clamp_min(1)
            per_seq = adv_seq is not None
            if per_seq:
                drop = opsm_drop(seq_kl, adv_seq, opsm_delta)  # (S,)
                keep = (~drop).to(dtype)
                weight = weight * (keep if level == "sequence" else per_token(keep))
            else:  # per-token advantages (token terms only): the negative tokens of a drifted sequence
                drop = opsm_drop(per_token(seq_kl), adv_token, opsm_delta)  # (N,)
                weight = weight * (~drop).to(dtype)
            metrics |= fractions(drop, per_seq, "opsm_masked")
    return weight, metrics
