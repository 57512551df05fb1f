"""Policy objectives as pure tensor functions: the GSPO family (arXiv 2507.18071) and its relatives.

``compute_loss(LossSpec(...), LossInputs(...))`` returns ``(loss, metrics)`` from two records: the
objective's settings (`LossSpec`, the config's ``train.*`` names) and its tensors, packed (N,) or built
from the padded form (`LossInputs.padded`); ``policy_loss("gspo", logp, old_logp, advantages, mask)`` is the
one-call form on a padded (B, T) batch. Objectives (gspo.core.registry): GSPO, GSPO-token and GRPO (the
GSPO paper), GMPO (arXiv 2507.20673), SAPO at token and sequence level (arXiv 2511.20347) and CISPO
(MiniMax-M1, arXiv 2506.13585); Dr. GRPO and LUSPO are aggregations. Optional train-inference mismatch
corrections (gspo.core.corrections) weigh the policy term. The math is written once, on the packed stream;
docs/objectives.md has the formulas, aggregations, metrics and every deliberate departure from the papers
(a clamp on log-ratios before exp, a select for the clipped min).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from gspo.core.corrections import Correction, correction_level, correction_weights
from gspo.core.registry import (
    AGGREGATIONS,
    CORRECTION_BOUNDS,
    OBJECTIVES,
    PAPER_CLIP,
    PAPER_DEFAULTS,
    REGISTRY,
    SAMPLER_CORRECTIONS,
    SEQUENCE_OBJECTIVES,
    Aggregation,
    SamplerCorrection,
)
from gspo.core.surrogates import (
    LOG_RATIO_CLAMP,
    LOSSES,
    TERMS,
    ObjectiveError,
    Segments,
    Stream,
    Terms,
    exp_clamped,
    line_in,
    segment_sum,
)

__all__ = [
    "AGGREGATIONS",
    "OBJECTIVES",
    "PAPER_CLIP",
    "PAPER_DEFAULTS",
    "SEQUENCE_OBJECTIVES",
    "LossInputs",
    "LossOutputs",
    "LossSpec",
    "compute_loss",
    "loss_normalizer",
    "policy_loss",
]

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


class NonFiniteInput(ValueError):
    """A loss input is NaN or infinite where it counts; ``name`` says which (``logp``, ``old_logp``, ...)."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


class LossOutputs(NamedTuple):
    """What a loss returns: the scalar to minimise and its metrics, detached 0-d float32 tensors
    (docs/objectives.md, "Metrics"). A tuple too: ``loss, metrics = compute_loss(spec, inputs)``."""

    loss: Tensor
    metrics: dict[str, Tensor]


@dataclass(frozen=True)
class LossSpec:
    """The objective and its settings, named as the config's ``train.*`` keys (gspo.config.schema documents
    each), so a spec is the config's fields of the same names. A knob left None takes the objective's paper
    default (gspo.core.registry.PAPER_DEFAULTS); a knob the objective does not have is an error.

    eps_low, eps_high: the clip range [1 - eps_low, 1 + eps_high] (GMPO: [-eps_low, eps_high] on log r_t;
    CISPO: the range of its detached weight); tau_pos, tau_neg: SAPO's gate temperatures. aggregation: one
    of ``AGGREGATIONS``. beta: the weight of a k3 KL term to the reference policy (needs ref_logp).
    sampler_correction: "none" or a mismatch correction (needs sampler_logp), within [sampler_correction_min,
    sampler_correction_max] (None: its default, gspo.core.registry.CORRECTION_BOUNDS); opsm_delta: off-policy
    sequence masking's threshold (None: off), against sampler_logp, or old_logp without it. entropy_coef:
    the weight of an entropy bonus, the mean entropy of the policy's next-token distribution over the
    completion tokens subtracted from the loss (needs entropy), whatever the objective.
    """

    objective: str = "gspo"
    eps_low: float | None = None
    eps_high: float | None = None
    tau_pos: float | None = None
    tau_neg: float | None = None
    aggregation: Aggregation = "seq-mean-token-mean"
    beta: float = 0.0
    sampler_correction: SamplerCorrection = "none"
    sampler_correction_min: float | None = None
    sampler_correction_max: float | None = None
    opsm_delta: float | None = None
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        name = f"policy_loss({self.objective})"
        self.knobs()  # an unknown objective or a knob it does not have
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"{name}: unknown aggregation {self.aggregation!r}; choose one of {AGGREGATIONS}"
            )
        if self.opsm_delta is not None and not self.opsm_delta >= 0:
            raise ValueError(f"{name}: opsm_delta must be >= 0 (None disables), got {self.opsm_delta}")
        self.correction()  # the correction's name, level and bounds
        applied = {
            "sampler_correction": self.sampler_correction != "none",
            "opsm_delta": self.opsm_delta is not None,
            "beta": self.beta > 0,
        }
        if self.objective in LOSSES and any(applied.values()):
            key = next(k for k, on in applied.items() if on)
            raise ValueError(
                f"{name}: {key} is applied by gspo around an objective's terms, and {self.objective} computes "
                f"the whole loss itself: compute it there, or unset {key}"
            )

    def knobs(self) -> dict[str, float]:
        """The objective's knobs: its paper defaults, with the ones set here."""
        if self.objective not in REGISTRY:
            raise ValueError(
                f"policy_loss: unknown objective {self.objective!r}; choose one of {OBJECTIVES}, or register "
                "your own (gspo.core.surrogates.register_objective; train.objective: 'file.py:function')"
            )
        params = dict(REGISTRY[self.objective].defaults)
        for key in ("eps_low", "eps_high", "tau_pos", "tau_neg"):
            value = getattr(self, key)
            if value is None:
                continue
            if key not in params:
                raise ValueError(
                    f"policy_loss({self.objective}): {key} is not a knob of {self.objective}; its knobs are "
                    f"{', '.join(params)}"
                )
            params[key] = float(value)
        return params

    def for_token_advantages(self) -> LossSpec:
        """The spec for per-token advantages: a sequence objective becomes its registered token form
        (gspo -> gspo_token, the same value and gradient for per-sequence advantages); a token objective is
        itself; a sequence objective without one is an error naming the token objectives."""
        entry = REGISTRY[self.objective]
        if entry.level == "token":
            return self
        if entry.token_form is None:
            tokens = [name for name, o in REGISTRY.items() if o.level == "token"]
            raise ValueError(
                f"policy_loss({self.objective}) takes one advantage per sequence, and these are per token "
                f"(per-turn rewards): choose one of {', '.join(tokens)}"
            )
        return dataclasses.replace(self, objective=entry.token_form)

    def correction(self) -> Correction:
        """The mismatch corrections with their bounds resolved; a ValueError naming the fix for a wrong one."""
        name, correction = f"policy_loss({self.objective})", self.sampler_correction
        low, high = self.sampler_correction_min, self.sampler_correction_max
        if correction == "none":
            if low is not None or high is not None:
                raise ValueError(
                    f"{name}: sampler_correction_min / _max bound a correction: set sampler_correction too"
                )
            return Correction(opsm_delta=self.opsm_delta)
        if correction not in CORRECTION_BOUNDS:
            raise ValueError(
                f"{name}: sampler_correction: unknown correction {correction!r}; choose one of "
                f"{SAMPLER_CORRECTIONS}"
            )
        if REGISTRY[self.objective].level == "sequence" and correction_level(correction) == "token":
            raise ValueError(
                f"{name}: {correction} weighs tokens, but {self.objective} has one term per sequence; use "
                f"{correction.replace('token', 'sequence')} (the length-normalised sequence ratio)"
            )
        default_low, default_high = CORRECTION_BOUNDS[correction]
        low, high = default_low if low is None else low, default_high if high is None else high
        if (
            (low is not None and low < 0)
            or (high is not None and high <= 0)
            or (None not in (low, high) and low > high)
        ):
            raise ValueError(
                f"{name}: the correction's bounds must satisfy 0 <= C_min <= C_max, C_max > 0, got "
                f"sampler_correction_min={low}, sampler_correction_max={high}"
            )
        return Correction(correction, low, high, self.opsm_delta)


@dataclass(frozen=True)
class LossInputs:
    """The tensors of one loss, packed: N tokens in S segments (sequences), any tokens between them.

    logp, old_logp, ref_logp, sampler_logp: (N,); segment_ids: (N,) long, 0..S-1 on completion tokens, -1
    elsewhere; num_segments: S; advantages: (S,) per segment or (N,) per token (not for the sequence
    objectives). Tokens outside the segments may hold anything, even NaN: they get zero gradient.
    ``old_logp`` is a constant; on-policy callers pass ``logp.detach()`` (ratio 1, gradient not zero).
    ref_logp: the reference policy's (with beta > 0); sampler_logp: the sampling engine's (NaN where
    unknown), for the mismatch corrections. normalizer: the outer denominator (default: S, or the token
    count for token-mean); pass the whole batch's when it is split into minibatches, so accumulation is exact.
    token_advantages: whether advantages are per token (None: by shape; (S,) is per segment even if N == S).
    padded_shape: (B, T) when built by `LossInputs.padded` (errors then name rows and columns).
    entropy: (N,) the entropy of the policy's distribution at each token, with its gradient (for the
    entropy bonus; gspo.core.logprobs.token_logprobs(entropy=True)); entropy_normalizer: the number of
    completion tokens it is averaged over (default: this call's; pass the whole minibatch's when it is
    split into micro-batches, so accumulation is exact).
    """

    logp: Tensor
    old_logp: Tensor
    advantages: Tensor
    segment_ids: Tensor
    num_segments: int
    ref_logp: Tensor | None = None
    sampler_logp: Tensor | None = None
    normalizer: float | Tensor | None = None
    token_advantages: bool | None = None
    padded_shape: tuple[int, int] | None = None
    entropy: Tensor | None = None
    entropy_normalizer: float | Tensor | None = None

    def __post_init__(self) -> None:
        N, S = self.logp.shape[0], self.num_segments
        if self.logp.dim() != 1 or self.old_logp.shape != (N,) or self.segment_ids.shape != (N,):
            raise ValueError(
                "LossInputs: logp, old_logp and segment_ids must share one (N,) shape, got "
                f"{tuple(self.logp.shape)}, {tuple(self.old_logp.shape)}, {tuple(self.segment_ids.shape)}"
            )
        if self.segment_ids.dtype != torch.long:
            raise ValueError(f"LossInputs: segment_ids must be torch.long, got {self.segment_ids.dtype}")
        for key in ("ref_logp", "sampler_logp", "entropy"):
            x = getattr(self, key)
            if x is not None and x.shape != (N,):
                raise ValueError(f"LossInputs: {key} shape {tuple(x.shape)} != logp {tuple(self.logp.shape)}")
        if self.token_advantages is None:
            object.__setattr__(self, "token_advantages", self.advantages.shape != (S,))
        if self.advantages.shape != ((N,) if self.token_advantages else (S,)):
            raise ValueError(
                f"LossInputs: advantages must be ({S},) per segment or ({N},) per token, "
                f"got {tuple(self.advantages.shape)}"
            )
        for key in ("normalizer", "entropy_normalizer"):
            value = getattr(self, key)
            if isinstance(value, (int, float)) and value <= 0:
                raise ValueError(f"LossInputs: {key} must be positive, got {value}")

    @classmethod
    def padded(
        cls,
        logp: Tensor,
        old_logp: Tensor,
        advantages: Tensor,
        mask: Tensor,
        *,
        ref_logp: Tensor | None = None,
        sampler_logp: Tensor | None = None,
        normalizer: float | Tensor | None = None,
    ) -> LossInputs:
        """The packed form of a padded batch: logp, old_logp, mask, ref_logp, sampler_logp (B, T), mask bool
        (True on completion tokens); advantages (B,) per sequence or (B, T) per token. Segment id = row."""
        if logp.dim() != 2 or logp.shape != old_logp.shape or logp.shape != mask.shape:
            raise ValueError(
                "LossInputs.padded: logp, old_logp and mask must share one (B, T) shape, got "
                f"{tuple(logp.shape)}, {tuple(old_logp.shape)}, {tuple(mask.shape)}"
            )
        if mask.dtype != torch.bool:
            raise ValueError(f"LossInputs.padded: mask must be bool, got {mask.dtype}")
        for key, x in (("ref_logp", ref_logp), ("sampler_logp", sampler_logp)):
            if x is not None and x.shape != logp.shape:
                raise ValueError(
                    f"LossInputs.padded: {key} shape {tuple(x.shape)} != logp {tuple(logp.shape)}"
                )
        B, T = logp.shape
        if advantages.shape not in ((B,), (B, T)):
            raise ValueError(
                f"LossInputs.padded: advantages must be ({B},) or ({B}, {T}), got {tuple(advantages.shape)}"
            )
        rows = torch.arange(B, device=logp.device).unsqueeze(1).expand(B, T)
        return cls(
            logp.reshape(-1),
            old_logp.reshape(-1),
            advantages.reshape(-1) if advantages.dim() == 2 else advantages,
            torch.where(mask, rows, -1).reshape(-1),
            B,
            ref_logp=None if ref_logp is None else ref_logp.reshape(-1),
            sampler_logp=None if sampler_logp is None else sampler_logp.reshape(-1),
            normalizer=normalizer,
            token_advantages=advantages.dim() == 2,
            padded_shape=(B, T),
        )


def policy_loss(
    objective: str | LossSpec, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, **knobs: Any
) -> LossOutputs:
    """The policy loss of ``objective`` (one of ``OBJECTIVES``, or a `LossSpec`) on a padded batch, and its
    metrics, in one call: ``compute_loss(LossSpec(objective, **knobs), LossInputs.padded(logp, old_logp,
    advantages, mask))``.

    logp, old_logp, mask: (B, T), mask bool (True on completion tokens); advantages (B,) per sequence or (B, T)
    per token (not for the sequence objectives gspo, gmpo, sapo_seq). knobs: the fields of `LossSpec` (eps_low,
    eps_high, tau_pos, tau_neg, aggregation, ...). A loss that needs more tensors (a reference's or the
    sampler's log-probs, a normalizer) or the packed form: `compute_loss` with `LossInputs`.

    >>> loss, metrics = policy_loss("gspo", logp, old_logp, advantages, mask)  # doctest: +SKIP
    """
    spec = (
        dataclasses.replace(objective, **knobs)
        if isinstance(objective, LossSpec)
        else LossSpec(objective, **knobs)
    )
    return compute_loss(spec, LossInputs.padded(logp, old_logp, advantages, mask))


def compute_loss(
    spec: LossSpec,
    inputs: LossInputs,
    *,
    check_finite: bool = True,
    segment_sum_reduce: Callable[[Tensor], Tensor] | None = None,
) -> LossOutputs:
    """The policy loss of ``spec`` on ``inputs``: a scalar to minimise and its metrics, detached 0-d float32
    tensors (docs/objectives.md); a user objective declared ``whole=True`` computes both itself.

    loss = sum_t w_t c_t L_t / normalizer (+ beta kl), L the objective's terms, c_t the corrections' weights,
    w_t = 1/|y_i| for "seq-mean-token-mean", else 1.
    check_finite: raise ValueError on NaN/inf at a valid position (the one host sync).
    segment_sum_reduce: a differentiable all-reduce of the (2, S) per-segment sums for sequences split
    across ranks; the ranks' losses and gradients then sum to the unsplit ones.
    """
    _check_inputs(spec, inputs, segment_sum_reduce)
    if check_finite:
        _check_finite(f"policy_loss({spec.objective})", inputs)
    if spec.objective in LOSSES:
        return _with_entropy_bonus(spec, inputs, _whole_loss(spec, inputs))
    s = _stream(inputs, segment_sum_reduce)
    level = REGISTRY[spec.objective].level
    terms = _terms(spec, s)
    correction = spec.correction()
    weight, metrics = None, {}  # weight: (S,) or (N,), the corrections' weight of each term
    if correction.name is not None or correction.opsm_delta is not None:
        weight, metrics = correction_weights(s, level, inputs.sampler_logp, correction)
    token_weight, normalizer = _token_weights(spec.aggregation, s, inputs.normalizer)
    policy = _aggregate(terms, level, weight, token_weight, s) / normalizer
    loss = policy
    metrics["loss"] = policy
    if inputs.ref_logp is not None:
        kl = _kl(inputs.ref_logp, s, token_weight) / normalizer
        loss = loss + spec.beta * kl
        metrics["kl"] = kl
    metrics |= _metrics(terms, level, s)
    return _with_entropy_bonus(
        spec, inputs, LossOutputs(loss, {k: v.detach().to(torch.float32) for k, v in metrics.items()})
    )


def _with_entropy_bonus(spec: LossSpec, inputs: LossInputs, out: LossOutputs) -> LossOutputs:
    """``out`` with the entropy bonus: loss - entropy_coef * sum_t H_t / n over the completion tokens (n:
    inputs.entropy_normalizer, or their count here), and the metric ``entropy``, their mean here. TRL's form:
    a token mean, whatever the objective's aggregation, so the coefficient means the same for every one."""
    if inputs.entropy is None:
        return out
    valid = inputs.segment_ids >= 0
    # select before any arithmetic: off-segment values (maybe NaN) get zero gradient
    entropy = torch.where(valid, inputs.entropy, 0.0)  # (N,)
    count = valid.sum().clamp_min(1)
    normalizer = count if inputs.entropy_normalizer is None else inputs.entropy_normalizer
    loss = out.loss - spec.entropy_coef * entropy.sum() / normalizer
    return LossOutputs(loss, out.metrics | {"entropy": (entropy.sum() / count).detach().to(torch.float32)})


def _whole_loss(spec: LossSpec, inputs: LossInputs) -> LossOutputs:
    """A user objective's whole loss, its result checked (a scalar, a mapping of scalar metrics) and any
    error it raises named with its file and line."""
    function = LOSSES[spec.objective]
    code = getattr(function, "__code__", None)
    where = f" ({code.co_filename})" if code is not None else ""
    try:
        out = function(spec, inputs)
    except Exception as error:
        at = f" at {code.co_filename}{line_in(error, code.co_filename)}" if code is not None else ""
        raise ObjectiveError(
            f"objective {spec.objective!r} raised {type(error).__name__}: {error}{at}"
        ) from error
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ObjectiveError(
            f"objective {spec.objective!r}{where} returned a {type(out).__name__}; a whole loss returns "
            "gspo.LossOutputs(loss, metrics)"
        )
    loss, metrics = out
    if not isinstance(loss, Tensor) or loss.numel() != 1 or not isinstance(metrics, dict):
        raise ObjectiveError(
            f"objective {spec.objective!r}{where} returned LossOutputs({type(loss).__name__}, "
            f"{type(metrics).__name__}); its loss is a scalar tensor, its metrics a dict of numbers"
        )
    try:
        metrics = {
            str(k): torch.as_tensor(v).detach().reshape(()).to(torch.float32) for k, v in metrics.items()
        }
    except (TypeError, ValueError, RuntimeError) as error:
        raise ObjectiveError(
            f"objective {spec.objective!r}{where}: a metric is not one number ({error})"
        ) from None
    return LossOutputs(loss.reshape(()), metrics)


def _check_inputs(
    spec: LossSpec, inputs: LossInputs, segment_sum_reduce: Callable[[Tensor], Tensor] | None
) -> None:
    """What the spec and the inputs need of each other (each is checked on its own when built)."""
    name = f"policy_loss({spec.objective})"
    if spec.aggregation == "seq-mean-token-sum-norm" and inputs.normalizer is None:
        raise ValueError(
            f"{name}: aggregation seq-mean-token-sum-norm (Dr. GRPO) divides by a constant: pass "
            "normalizer = number of sequences x the maximum completion length (LossInputs.normalizer)"
        )
    if spec.entropy_coef != 0 and inputs.entropy is None:
        raise ValueError(
            f"{name}: entropy_coef={spec.entropy_coef} needs entropy, the policy's entropy at each token "
            "(LossInputs.entropy; gspo.core.logprobs.token_logprobs(..., entropy=True))"
        )
    if spec.sampler_correction != "none" and inputs.sampler_logp is None:
        raise ValueError(
            f"{name}: sampler_correction {spec.sampler_correction!r} needs sampler_logp, the sampler's log-probs "
            "(LossInputs.sampler_logp)"
        )
    if segment_sum_reduce is not None:
        if inputs.padded_shape is not None:
            raise ValueError(f"{name}: segment_sum_reduce needs the packed form (segment_ids)")
        if spec.objective in LOSSES:
            raise ValueError(f"{name}: a whole loss of your own cannot take sequences split across ranks")
        if spec.objective == "gmpo" or spec.sampler_correction != "none" or spec.opsm_delta is not None:
            raise ValueError(
                f"{name}: segment_sum_reduce (sequences split across ranks) supports neither gmpo nor the "
                "mismatch corrections: their per-sequence means would need further all-reduces"
            )


def _check_finite(name: str, inputs: LossInputs) -> None:
    """Raise ValueError naming the first non-finite value at a valid position, or an out-of-range segment
    id; one host sync for all checks. Positions: (row r[, col c]) of a padded batch, else index / segment."""
    S, segment_ids = inputs.num_segments, inputs.segment_ids
    valid = segment_ids >= 0
    if inputs.token_advantages:
        adv_valid, adv_unit = valid, "index"
    else:  # the segments present
        present = torch.zeros(S + 1, dtype=torch.bool, device=valid.device)
        present[torch.where(valid, segment_ids, S).clamp_max(S)] = True
        adv_valid, adv_unit = present[:S], "segment"
    checks = [("logp", inputs.logp, valid, "index"), ("old_logp", inputs.old_logp, valid, "index")]
    checks.append(("advantages", inputs.advantages, adv_valid, adv_unit))
    if inputs.ref_logp is not None:
        checks.append(("ref_logp", inputs.ref_logp, valid, "index"))
    bad = [(key, t.detach(), ok & ~torch.isfinite(t.detach()), unit) for key, t, ok, unit in checks]
    out_of_range = segment_ids >= S
    if not torch.stack([b.any() for _, _, b, _ in bad] + [out_of_range.any()]).any():  # the one sync
        return
    for key, t, b, unit in bad:
        if b.any():
            i = int(b.nonzero()[0, 0])
            raise NonFiniteInput(
                key,
                f"{name}: {key} is {t[i].item()} at valid position {_where(i, unit, inputs.padded_shape)} "
                f"({int(b.sum())} bad in all). Hint: {_HINTS[key]}. Values outside the mask/segments may be "
                "anything; check_finite=False skips this check.",
            )
    i = int(out_of_range.nonzero()[0, 0])
    raise ValueError(
        f"{name}: segment_ids[{i}] = {segment_ids[i].item()} is out of range for num_segments={S}. Hint: "
        "number segments 0..num_segments-1, -1 for no segment."
    )


def _where(i: int, unit: str, padded_shape: tuple[int, int] | None) -> str:
    """A position in the caller's terms: (row r, col c) / (row r) of a padded batch, else index / segment."""
    if padded_shape is None:
        return f"{unit} {i}"
    return f"(row {i})" if unit == "segment" else f"(row {i // padded_shape[1]}, col {i % padded_shape[1]})"


def _stream(inputs: LossInputs, segment_sum_reduce: Callable[[Tensor], Tensor] | None) -> Stream:
    """The pieces every objective shares: log-ratios per token and per sequence, counts and advantages."""
    S = inputs.num_segments
    dtype = torch.promote_types(inputs.logp.dtype, torch.float32)
    valid = inputs.segment_ids >= 0  # (N,)
    bucket = torch.where(valid, inputs.segment_ids, S)  # (N,) tokens without a segment go to a spare bucket S
    # select before any arithmetic: off-segment values (maybe NaN) then get exactly zero gradient
    lp = torch.where(valid, inputs.logp.to(dtype), 0.0)  # (N,)
    old_lp = torch.where(valid, inputs.old_logp.detach().to(dtype), 0.0)  # (N,)
    # log r_t = logp_t - old_logp_t   (N,)
    log_ratio = lp - old_lp
    local_count = segment_sum(valid.to(dtype), bucket, S)  # (S,) this rank's |y_i|
    # sequence parallelism: the (2, S) sums of log-ratios and counts are reduced over the ranks that
    # share segments before any ratio is formed (the design of Fast-LLM's GSPO loss)
    sums = torch.stack([segment_sum(log_ratio, bucket, S), local_count])  # (2, S)
    if segment_sum_reduce is not None:
        sums = segment_sum_reduce(sums)
    seg = Segments(valid, bucket, count=sums[1].detach(), local_count=local_count)  # count: global |y_i|
    # log s_i = (1/|y_i|) sum_t log r_t   (S,)
    seq_log_ratio = sums[0] / seg.count.clamp_min(1)
    adv = inputs.advantages.detach().to(dtype)
    if inputs.token_advantages:
        adv_seq, adv_token = None, torch.where(valid, adv, 0.0)  # (N,)
    else:
        adv_seq = torch.where(seg.count > 0, adv, 0.0)  # (S,)
        adv_token = seg.per_token(adv_seq)  # (N,)
    return Stream(seg, lp, old_lp, log_ratio, seq_log_ratio, adv_seq, adv_token)


def loss_normalizer(
    aggregation: str, sequences: int | Tensor, tokens: int | Tensor, max_new_tokens: int | None = None
) -> int | Tensor:
    """The outer denominator of an aggregation: the number of ``sequences`` (the paper's 1/G per sequence),
    the number of trained ``tokens`` for "token-mean", or sequences x ``max_new_tokens`` for
    "seq-mean-token-sum-norm" (Dr. GRPO's constant). The learner passes a whole minibatch's counts, so its
    micro-batches (and ranks) sum to the minibatch's loss."""
    if aggregation == "token-mean":
        return tokens
    if aggregation == "seq-mean-token-sum-norm":
        if max_new_tokens is None:
            raise ValueError("aggregation seq-mean-token-sum-norm (Dr. GRPO) needs max_new_tokens")
        return sequences * max_new_tokens
    return sequences


def _terms(spec: LossSpec, s: Stream) -> Terms:
    """The objective's terms; a user objective's checked (their kind and shapes), and any error it raises
    named with its file and line."""
    function = TERMS[spec.objective]
    if spec.objective in OBJECTIVES:
        return function(s, spec.knobs())
    code = getattr(function, "__code__", None)
    try:
        terms = function(s, spec.knobs())
    except Exception as error:
        where = f" at {code.co_filename}{line_in(error, code.co_filename)}" if code is not None else ""
        raise ObjectiveError(
            f"objective {spec.objective!r} raised {type(error).__name__}: {error}{where}"
        ) from error
    size = len(s.seq_log_ratio) if REGISTRY[spec.objective].level == "sequence" else len(s.lp)
    unit = "sequence" if REGISTRY[spec.objective].level == "sequence" else "token"
    if not isinstance(terms, Terms) or any(
        not isinstance(x, Tensor) or x.shape != (size,) for x in (terms.loss, terms.low, terms.high)
    ):
        raise ObjectiveError(
            f"objective {spec.objective!r} must return Terms(loss, low, high) of shape ({size},), one per "
            f"{unit} (its level), got {_describe(terms)}"
        )
    return terms


def _describe(terms: Any) -> str:
    if not isinstance(terms, Terms):
        return type(terms).__name__
    shapes = [
        tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        for x in (terms.loss, terms.low, terms.high)
    ]
    return f"Terms with shapes {shapes}"


def _token_weights(
    aggregation: str, s: Stream, normalizer: float | Tensor | None
) -> tuple[Tensor, float | Tensor]:
    """w_t (N,) and the outer denominator: w_t = 1/|y_i| for "seq-mean-token-mean" (each sequence counts
    once), else 1; the denominator by default S, or the token count for "token-mean"."""
    if aggregation == "seq-mean-token-mean":
        token_weight = torch.where(s.seg.valid, 1.0 / s.seg.per_token(s.seg.count).clamp_min(1), 0.0)
    else:
        token_weight = s.seg.valid.to(s.lp.dtype)
    if normalizer is None:
        normalizer = loss_normalizer(aggregation, max(len(s.seg.count), 1), s.seg.count.sum().clamp_min(1))
    return token_weight, normalizer


def _aggregate(terms: Terms, level: str, weight: Tensor | None, token_weight: Tensor, s: Stream) -> Tensor:
    """sum_t w_t c_t L_t: the weighted sum of the (corrected) terms, before the outer denominator."""
    term_loss = terms.loss if weight is None else weight * terms.loss
    if level == "sequence":  # a rank weighs L_i by its share of the tokens of i
        return (s.seg.sum(token_weight) * term_loss).sum()
    return (token_weight * term_loss).sum()


def _kl(ref_logp: Tensor, s: Stream, token_weight: Tensor) -> Tensor:
    """sum_t w_t kl_t, kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1 (k3 estimator), before the
    outer denominator."""
    ref = torch.where(s.seg.valid, ref_logp.detach().to(s.lp.dtype), 0.0)  # (N,)
    delta = (ref - s.lp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (token_weight * (torch.exp(delta) - delta - 1)).sum()


def _stats(x: Tensor, mask: Tensor, prefix: str) -> dict[str, Tensor]:
    """{prefix}_mean, _min, _max of x where mask, detached. An empty mask gives a mean of 0 and the
    extremes' identities, +inf and -inf, which reduce_metrics leaves out: a micro-batch or rank that
    trained no token (all its samples skipped, or a sequence-parallel slice of prompt tokens) does not
    pull a minimum to 0."""
    x, n = x.detach(), mask.sum()
    mean = torch.where(mask, x, 0.0).sum() / n.clamp_min(1)
    lo = torch.where(mask, x, float("inf")).amin() if x.numel() else x.new_tensor(float("inf"))
    hi = torch.where(mask, x, float("-inf")).amax() if x.numel() else x.new_tensor(float("-inf"))
    return {f"{prefix}_mean": mean, f"{prefix}_min": lo, f"{prefix}_max": hi}


@torch.no_grad()
def _metrics(terms: Terms, level: str, s: Stream) -> dict[str, Tensor]:
    """Clipped fractions per token and per sequence, ratio statistics and counts (docs/objectives.md)."""
    dtype, seg, valid, nonempty = s.lp.dtype, s.seg, s.seg.valid, s.seg.count > 0
    if (terms.cut_level or level) == "sequence":  # a token is clipped when its sequence is
        token_low, token_high = (
            seg.per_token(terms.low.to(dtype)) > 0,
            seg.per_token(terms.high.to(dtype)) > 0,
        )
        # clipped as a whole; global with reduced sums
        seq_present, seq_frac_low, seq_frac_high = nonempty, terms.low.to(dtype), terms.high.to(dtype)
    else:
        token_low, token_high = terms.low, terms.high
        seq_present = seg.local_count > 0
        seq_frac_low = seg.sum((token_low & valid).to(dtype)) / seg.local_count.clamp_min(1)
        seq_frac_high = seg.sum((token_high & valid).to(dtype)) / seg.local_count.clamp_min(1)
    if s.adv_seq is None:
        seq_nonzero_adv = seg.sum((s.adv_token != 0).to(dtype)) > 0
    else:
        seq_nonzero_adv = nonempty & (s.adv_seq != 0)
    token_low, token_high = token_low & valid, token_high & valid
    num_tokens = valid.sum().to(dtype)
    num_present = seq_present.sum().clamp_min(1)
    return {
        "clip_frac_token": (token_low | token_high).sum() / num_tokens.clamp_min(1),
        "clip_frac_token_low": token_low.sum() / num_tokens.clamp_min(1),
        "clip_frac_token_high": token_high.sum() / num_tokens.clamp_min(1),
        "clip_frac_seq": torch.where(seq_present, seq_frac_low + seq_frac_high, 0.0).sum() / num_present,
        "clip_frac_seq_low": torch.where(seq_present, seq_frac_low, 0.0).sum() / num_present,
        "clip_frac_seq_high": torch.where(seq_present, seq_frac_high, 0.0).sum() / num_present,
        **_stats(exp_clamped(s.seq_log_ratio), nonempty, "ratio_seq"),
        **_stats(exp_clamped(s.log_ratio), valid, "ratio_token"),
        "log_ratio_abs_mean": s.log_ratio.abs().sum() / num_tokens.clamp_min(1),  # zero off-segment
        "num_seq_nonzero_adv": seq_nonzero_adv.sum(),
        "num_sequences": nonempty.sum(),
        "num_tokens": num_tokens,
    }
