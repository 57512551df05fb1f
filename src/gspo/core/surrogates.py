"""The objectives' terms: each objective is a small function from the shared pieces of a packed stream
(`Stream`: log-ratios per token and per sequence, advantages) to its loss terms (`Terms`), registered with
``@terms_of(name)`` against its entry in gspo.core.registry (its level and paper defaults); a user's own
objective is the same kind of function, declared with ``@objective(level=..., **knobs)`` and registered
with `register_objective`. gspo.core.objectives aggregates the terms, applies the mismatch corrections and
computes the metrics; docs/objectives.md has every formula and departure from the papers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from gspo.core.registry import OBJECTIVES, REGISTRY, Objective

LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to +-20 before exp: a finite loss and gradient for any input."""
GATE_HALF = 0.5
"""SAPO counts a token (sequence) as gated where the gate keeps less than half of its gradient weight."""


@dataclass(frozen=True)
class Segments:
    """Which of S segments (sequences) each of N packed tokens belongs to, and the segments' sizes."""

    valid: Tensor  # (N,) bool, the token belongs to a segment
    bucket: Tensor  # (N,) long, its segment; S (a spare bucket) off-segment
    count: Tensor  # (S,) |y_i|, over all ranks that share segments (detached)
    local_count: Tensor  # (S,) this rank's tokens of each segment

    def sum(self, x: Tensor) -> Tensor:
        """(N,) -> (S,): each segment's sum over this rank's tokens."""
        return segment_sum(x, self.bucket, len(self.count))

    def mean(self, x: Tensor) -> Tensor:
        """(N,) -> (S,): (1/|y_i|) sum over the segment's tokens."""
        return self.sum(x) / self.count.clamp_min(1)

    def per_token(self, x: Tensor) -> Tensor:
        """(S,) -> (N,): each token's segment's value, zero off-segment."""
        return torch.cat([x, x.new_zeros(1)])[self.bucket]


def segment_sum(x: Tensor, bucket: Tensor, num_segments: int) -> Tensor:
    """(N,) -> (S,): the sum of x over each segment's tokens, ``bucket`` (N,) their segment (S: none)."""
    return x.new_zeros(num_segments + 1).index_add(0, bucket, x)[:num_segments]


@dataclass(frozen=True)
class Stream:
    """What every objective (and correction) reads, on a packed stream of N tokens in S segments: the
    log-probs zeroed off-segment (selected before any arithmetic, so NaN there gets zero gradient)."""

    seg: Segments
    lp: Tensor  # (N,) logp, 0 off-segment, with grad
    old_lp: Tensor  # (N,) old_logp, 0 off-segment, detached
    log_ratio: Tensor  # (N,) logp - old_logp, 0 off-segment
    seq_log_ratio: Tensor  # (S,) (1/|y_i|) sum_t log r_t, from the (possibly rank-reduced) sums
    adv_seq: Tensor | None  # (S,) per-sequence advantages, 0 for empty sequences; None if per token
    adv_token: Tensor  # (N,) every token's advantage, 0 off-segment


@dataclass(frozen=True)
class Terms:
    """An objective's loss terms, per sequence (S,) or per token (N,) as its registry entry's level says,
    and where it cuts the gradient ("low": below the trust region, "high": above it; for SAPO where the gate
    halves it, for CISPO where the weight is truncated), per sequence or per token (``cut_level``)."""

    loss: Tensor
    low: Tensor
    high: Tensor
    cut_level: str | None = None  # "sequence" or "token"; None: the objective's level


TermsFunction = Callable[[Stream, Mapping[str, float]], Terms]
TERMS: dict[str, TermsFunction] = {}
"""Each objective's terms function, by name; filled by `terms_of`."""
LOSSES: dict[str, Callable[..., Any]] = {}
"""User objectives that compute the whole loss (aggregation and metrics included), by name: functions
``(spec: LossSpec, inputs: LossInputs) -> LossOutputs`` declared with ``@objective(..., whole=True)``."""


class ObjectiveError(ValueError):
    """A user objective that cannot be used: undeclared, a name taken, or terms of the wrong kind."""


def line_in(error: BaseException, path: str | Path) -> str:
    """ " (line N)": the innermost line of the user's file `path` that the error passed through (or its
    syntax error's), for messages that point at the user's code."""
    if isinstance(error, SyntaxError) and error.lineno:
        return f" (line {error.lineno})"
    lines, tb = [], error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == str(path):
            lines.append(tb.tb_lineno)
        tb = tb.tb_next
    return f" (line {lines[-1]})" if lines else ""


def objective(
    *,
    level: Literal["sequence", "token"],
    token_form: str | None = None,
    whole: bool = False,
    **defaults: float,
) -> Callable[[TermsFunction], TermsFunction]:
    """Declare a terms function as an objective of your own: the unit of its terms (``level``: "sequence",
    one term per sequence, or "token") and its knobs with their defaults (``eps_low=3e-4, eps_high=4e-4``:
    a clip range the config's train.eps_low / train.eps_high set; other names are constants it reads from
    its ``knobs``). The aggregation (train.aggregation) and so the normaliser are the config's, as for the
    built-ins. Load it with ``train.objective: "path/file.py:function"`` or `register_objective`.

    >>> @objective(level="sequence", eps_low=3e-4, eps_high=4e-4)  # doctest: +SKIP
    ... def my_gspo(s: Stream, knobs: Mapping[str, float]) -> Terms: ...

    ``whole=True`` declares the whole loss instead: ``(spec: LossSpec, inputs: LossInputs) -> LossOutputs``,
    the aggregation (over ``inputs.normalizer``, the whole minibatch's, so micro-batches sum to it) and the
    metrics its own; the mismatch corrections, the KL term and sequence parallelism are then not applied.
    """
    if level not in ("sequence", "token"):
        raise ObjectiveError(f"@objective(level={level!r}): level is 'sequence' or 'token'")
    entry = Objective(level, {k: float(v) for k, v in defaults.items()}, token_form)

    def declare(function: TermsFunction) -> TermsFunction:
        function.gspo_objective = entry  # type: ignore[attr-defined]
        function.gspo_whole_loss = whole  # type: ignore[attr-defined]
        return function

    return declare


def register_objective(name: str, function: TermsFunction) -> None:
    """Make ``function`` (declared with `objective`) the objective ``name`` of `compute_loss` and of the
    config's train.objective; the built-ins' names are taken."""
    entry = getattr(function, "gspo_objective", None)
    if not isinstance(entry, Objective):
        raise ObjectiveError(
            f"objective {name!r}: {getattr(function, '__name__', function)!r} is not declared: decorate it with "
            "@gspo.objective(level='sequence' or 'token', eps_low=..., eps_high=...) (docs/objectives.md)"
        )
    if name in OBJECTIVES:
        raise ObjectiveError(f"objective {name!r} is a built-in; register yours under another name")
    if entry.token_form is not None and entry.token_form not in REGISTRY:
        raise ObjectiveError(f"objective {name!r}: its token_form {entry.token_form!r} is not an objective")
    REGISTRY[name] = entry
    if getattr(function, "gspo_whole_loss", False):
        LOSSES[name] = function
        TERMS.pop(name, None)
    else:
        TERMS[name] = function
        LOSSES.pop(name, None)


def terms_of(name: str) -> Callable[[TermsFunction], TermsFunction]:
    """Register the decorated function as the terms of objective ``name`` (an entry of gspo.core.registry)."""
    if name not in REGISTRY:
        raise ValueError(f"terms_of({name!r}): add the objective to gspo.core.registry.REGISTRY first")

    def register(function: TermsFunction) -> TermsFunction:
        TERMS[name] = function
        return function

    return register


def _clipped_surrogate(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float):
    """-min(ratio A, clip(ratio, 1-eps_low, 1+eps_high) A) and where clipping zeroes the gradient."""
    high = (adv > 0) & (ratio > 1 + eps_high)
    low = (adv < 0) & (ratio < 1 - eps_low)
    # the clipped branch is a constant: select it rather than take min(), so the gradient is explicit
    clipped_value = ratio.detach().clamp(1 - eps_low, 1 + eps_high) * adv
    return -torch.where(high | low, clipped_value, ratio * adv), low, high


def _soft_gate(ratio: Tensor, adv: Tensor, tau_pos: float, tau_neg: float):
    """-f(ratio) A with f(x) = sigmoid(tau (x - 1)) 4 / tau, tau = tau_pos if A > 0 else tau_neg; and where
    the gate keeps less than half the gradient weight, f'(x) = sech^2(tau (x - 1) / 2) < 1/2."""
    tau = torch.where(adv > 0, ratio.new_tensor(tau_pos), ratio.new_tensor(tau_neg))  # ratio's dtype
    x = tau * (ratio - 1)
    gated = 4 * torch.sigmoid(x.detach()) * torch.sigmoid(-x.detach()) < GATE_HALF  # f'(ratio)
    return -torch.sigmoid(x) * (4 / tau) * adv, gated & (ratio < 1), gated & (ratio > 1)


def exp_clamped(x: Tensor) -> Tensor:
    return torch.exp(x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _sequence_advantages(s: Stream, name: str) -> Tensor:
    if s.adv_seq is None:
        others = [o for o, entry in REGISTRY.items() if entry.level == "token" and o != "gspo_token"]
        raise ValueError(
            f"{name} takes one advantage per sequence; use objective gspo_token for per-token ones (or "
            f"{', '.join(others)})"
        )
    return s.adv_seq


@terms_of("gspo")
def _gspo(s: Stream, p: Mapping[str, float]) -> Terms:
    """GSPO, Eq. 5-7: s_i = exp((1/|y_i|) sum_t log r_t); L_i = -min(s_i A_i, clip(s_i) A_i)."""
    adv = _sequence_advantages(s, "gspo")
    seq_ratio = exp_clamped(s.seq_log_ratio)  # (S,)
    return Terms(*_clipped_surrogate(seq_ratio, adv, p["eps_low"], p["eps_high"]))


@terms_of("gspo_token")
def _gspo_token(s: Stream, p: Mapping[str, float]) -> Terms:
    """GSPO-token, Eq. 13-14: s_i,t = sg[s_i] exp(logp_t - sg[logp_t]); L_t = -min(s_i,t A_t, clip(s_i,t) A_t)."""
    ratio = exp_clamped(s.seg.per_token(s.seq_log_ratio.detach()) + s.lp - s.lp.detach())  # (N,)
    return Terms(*_clipped_surrogate(ratio, s.adv_token, p["eps_low"], p["eps_high"]))


@terms_of("grpo")
def _grpo(s: Stream, p: Mapping[str, float]) -> Terms:
    """GRPO, Eq. 2: r_t = exp(logp_t - old_logp_t); L_t = -min(r_t A_t, clip(r_t) A_t)."""
    ratio = exp_clamped(s.log_ratio)  # (N,)
    return Terms(*_clipped_surrogate(ratio, s.adv_token, p["eps_low"], p["eps_high"]))


@terms_of("gmpo")
def _gmpo(s: Stream, p: Mapping[str, float]) -> Terms:
    """GMPO (arXiv 2507.20673): the geometric mean of the token ratios, each clipped in log space first.

    m_t = sgn(A_i) min(sgn(A_i) log r_t, sgn(A_i) clip(log r_t, -eps_low, eps_high))   (N,)
    g_i = exp((1/|y_i|) sum_t m_t);  L_i = -A_i g_i   (S,)
    A token whose log-ratio is clipped (A > 0 above eps_high, A < 0 below -eps_low) gives no gradient.
    """
    adv = _sequence_advantages(s, "gmpo")
    high = (s.adv_token > 0) & (s.log_ratio > p["eps_high"])  # (N,)
    low = (s.adv_token < 0) & (s.log_ratio < -p["eps_low"])
    clipped = s.log_ratio.detach().clamp(-p["eps_low"], p["eps_high"])
    geo_ratio = exp_clamped(s.seg.mean(torch.where(high | low, clipped, s.log_ratio)))  # (S,)
    return Terms(-adv * geo_ratio, low, high, cut_level="token")


@terms_of("sapo")
def _sapo(s: Stream, p: Mapping[str, float]) -> Terms:
    """SAPO (arXiv 2511.20347), token level: L_t = -f(r_t) A_t, f(x) = sigmoid(tau (x - 1)) 4 / tau.

    The soft gate replaces the hard clip: f'(1) = 1 (GRPO's on-policy gradient), decaying smoothly away from
    r = 1; tau = tau_pos for A_t > 0, tau_neg for A_t <= 0 (negative tokens are damped faster).
    """
    ratio = exp_clamped(s.log_ratio)  # (N,)
    return Terms(*_soft_gate(ratio, s.adv_token, p["tau_pos"], p["tau_neg"]))


@terms_of("sapo_seq")
def _sapo_seq(s: Stream, p: Mapping[str, float]) -> Terms:
    """SAPO at sequence level (GSPO's ratio under SAPO's gate): L_i = -f(s_i) A_i."""
    adv = _sequence_advantages(s, "sapo_seq")
    seq_ratio = exp_clamped(s.seq_log_ratio)  # (S,)
    return Terms(*_soft_gate(seq_ratio, adv, p["tau_pos"], p["tau_neg"]))


@terms_of("cispo")
def _cispo(s: Stream, p: Mapping[str, float]) -> Terms:
    """CISPO (MiniMax-M1, Eq. 4-5): L_t = -sg[clip(r_t, 1 - eps_low, 1 + eps_high)] A_t logp_t.

    The clipped importance weight is a constant, so a truncated token still carries the gradient -w A; the
    value (with logp_t, as in TRL, verl, slime and ART) is not a surrogate of the return.
    """
    ratio = exp_clamped(s.log_ratio)  # (N,)
    high, low = ratio > 1 + p["eps_high"], ratio < 1 - p["eps_low"]
    weight = ratio.detach().clamp(1 - p["eps_low"], 1 + p["eps_high"])
    return Terms(-weight * s.adv_token * s.lp, low, high)


if set(TERMS) != set(OBJECTIVES):  # an entry of gspo.core.registry without its terms function
    raise ImportError(
        f"objectives without a terms function: {sorted(set(OBJECTIVES) - set(TERMS))}; register one with "
        "@terms_of(name) in gspo.core.surrogates"
    )
