"""Numbers, not shapes: the objectives against hand values, a naive per-sequence loop, and each other."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from gspo.core.objectives import (
    AGGREGATIONS,
    PAPER_CLIP,
    PAPER_DEFAULTS,
    SEQUENCE_OBJECTIVES,
    LossInputs,
    LossSpec,
    compute_loss,
    policy_loss,
)
from gspo.core.objectives import OBJECTIVES as KINDS

NORM_TOKENS = 7
"""The constant of aggregation seq-mean-token-sum-norm (Dr. GRPO) in these tests: normalizer = B x 7."""


def knobs(kind, eps_low=None, eps_high=None, **kwargs):
    """A test's clip range as the objective's knobs: SAPO has temperatures instead (tighter range, sharper gate)."""
    if kind in ("sapo", "sapo_seq"):
        if eps_low is not None:
            kwargs |= {"tau_pos": 0.2 / eps_high, "tau_neg": 0.3 / eps_low}
    else:
        kwargs |= {"eps_low": eps_low, "eps_high": eps_high}
    return kwargs


def _with_normalizer(kwargs, num_sequences):
    if kwargs.get("aggregation") == "seq-mean-token-sum-norm" and kwargs.get("normalizer") is None:
        kwargs = {**kwargs, "normalizer": num_sequences * NORM_TOKENS}
    return kwargs


INPUTS = ("ref_logp", "sampler_logp", "normalizer")
"""LossInputs' optional fields; compute_loss's options are check_finite and segment_sum_reduce."""


def _split(kwargs):
    """A test's keyword arguments as the loss's three parts: the spec's knobs, the inputs, the call's options."""
    inputs = {k: v for k, v in kwargs.items() if k in INPUTS}
    call = {k: v for k, v in kwargs.items() if k in ("check_finite", "segment_sum_reduce")}
    return {k: v for k, v in kwargs.items() if k not in inputs and k not in call}, inputs, call


def _padded(kind):
    def loss(logp, old_logp, advantages, mask, **kwargs):
        spec, inputs, call = _split(_with_normalizer(knobs(kind, **kwargs), mask.shape[0]))
        if not inputs and not call:  # the one-call form
            return policy_loss(kind, logp, old_logp, advantages, mask, **spec)
        padded = LossInputs.padded(logp, old_logp, advantages, mask, **inputs)
        return compute_loss(LossSpec(kind, **spec), padded, **call)

    return loss


def _packed(kind):
    def loss(logp, old_logp, advantages, segment_ids, num_segments, **kwargs):
        spec, inputs, call = _split(_with_normalizer(knobs(kind, **kwargs), num_segments))
        packed = LossInputs(logp, old_logp, advantages, segment_ids, num_segments, **inputs)
        return compute_loss(LossSpec(kind, **spec), packed, **call)

    return loss


OBJECTIVES = {kind: _padded(kind) for kind in KINDS}
PACKED_OBJECTIVES = {kind: _packed(kind) for kind in KINDS}
gspo_loss, gspo_token_loss, grpo_loss = OBJECTIVES["gspo"], OBJECTIVES["gspo_token"], OBJECTIVES["grpo"]
gspo_loss_packed, grpo_loss_packed = PACKED_OBJECTIVES["gspo"], PACKED_OBJECTIVES["grpo"]
METRIC_KEYS = {
    "loss",
    "clip_frac_token",
    "clip_frac_token_low",
    "clip_frac_token_high",
    "clip_frac_seq",
    "clip_frac_seq_low",
    "clip_frac_seq_high",
    "ratio_seq_mean",
    "ratio_seq_min",
    "ratio_seq_max",
    "ratio_token_mean",
    "ratio_token_min",
    "ratio_token_max",
    "log_ratio_abs_mean",
    "num_seq_nonzero_adv",
    "num_sequences",
    "num_tokens",
}
FAST = settings(max_examples=30, deadline=None)


def make_batch(seed, B=4, T=6, spread=0.3, per_token_adv=False, dtype=torch.float32, empty_row=None):
    """Random padded batch: lengths in [1, T] (row `empty_row` has none), padding filled with garbage."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T) < lengths[:, None]
    if empty_row is not None:
        mask[empty_row] = False
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = old + spread * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = old + spread * torch.randn(B, T, generator=g, dtype=torch.float64)
    shape = (B, T) if per_token_adv else (B,)
    adv = torch.randn(shape, generator=g, dtype=torch.float64)
    garbage = torch.full((B, T), float("nan"), dtype=torch.float64)
    logp, old, ref = (torch.where(mask, x, garbage) for x in (logp, old, ref))
    return logp.to(dtype).requires_grad_(), old.to(dtype), adv.to(dtype), mask, ref.to(dtype)


def naive_loss(
    kind,
    logp,
    old,
    adv,
    mask,
    eps_low,
    eps_high,
    aggregation,
    ref=None,
    beta=0.0,
    *,
    tau=None,
    sampler=None,
    correction=None,
    bounds=(None, None),
    opsm_delta=None,
):
    """The papers' formulas, one sequence at a time, with min() and clamp() as written; tau = SAPO's (pos, neg)."""
    B = logp.shape[0]
    terms, weights, total_tokens = [], [], 0
    for i in range(B):
        idx = mask[i].nonzero().flatten().tolist()
        n = len(idx)
        total_tokens += n
        if n == 0:
            continue
        lp, olp = logp[i, idx], old[i, idx]
        a = adv[i, idx] if adv.dim() == 2 else adv[i].expand(n)
        log_s = (lp - olp).mean()
        if (
            kind == "gmpo"
        ):  # m_t = sgn(A) min(sgn(A) l_t, sgn(A) clip(l_t, -eps_low, eps_high)) (verl's geo_mean)
            sgn, l = torch.sign(a), lp - olp
            m = sgn * torch.minimum(sgn * l, sgn * torch.clamp(l, -eps_low, eps_high))
            tok = (-a * torch.exp(m.mean()))[:1].expand(n)  # one term per sequence, on each of its tokens
        elif kind in ("sapo", "sapo_seq"):
            r = torch.exp(lp - olp) if kind == "sapo" else torch.exp(log_s).expand(n)
            # tau in the inputs' dtype: torch.where of two Python floats is float32, which rounds 1.05
            t = torch.where(a > 0, a.new_tensor(tau[0]), a.new_tensor(tau[1]))
            tok = -torch.sigmoid(t * (r - 1)) * 4 / t * a
        elif kind == "cispo":
            r = torch.exp(lp - olp)
            tok = -torch.clamp(r.detach(), 1 - eps_low, 1 + eps_high) * a * lp
        else:
            if kind == "gspo":
                ratio = torch.exp(log_s).expand(n)
            elif kind == "gspo_token":
                ratio = torch.exp(log_s.detach() + lp - lp.detach())
            else:
                ratio = torch.exp(lp - olp)
            tok = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a)
        if sampler is not None:
            s = sampler[i, idx]
            log_rho = torch.where(torch.isnan(s), 0.0, olp - s)
            if correction is not None:
                rho = (
                    torch.exp(log_rho.mean()).expand(n)
                    if correction.startswith("sequence")
                    else torch.exp(log_rho)
                )
                lo, hi = bounds
                if correction.endswith("truncate"):
                    w = rho.clamp(min=lo, max=hi)
                else:
                    w = torch.where((rho < (lo or 0.0)) | (rho > (hi or math.inf)), 0.0, rho)
                tok = tok * w
            if opsm_delta is not None:
                kl = torch.where(torch.isnan(s), olp, s) - lp.detach()
                tok = tok * torch.where((a < 0) & (kl.mean() > opsm_delta), 0.0, 1.0)
        if ref is not None:
            d = ref[i, idx] - lp
            tok = tok + beta * (torch.exp(d) - d - 1)
        terms.append(tok.sum())
        weights.append(1.0 / n if aggregation == "seq-mean-token-mean" else 1.0)
    total = sum(w * t for w, t in zip(terms, weights, strict=True)) if terms else logp.sum() * 0
    if aggregation == "seq-mean-token-sum-norm":
        return total / (B * NORM_TOKENS)
    return total / (max(total_tokens, 1) if aggregation == "token-mean" else B)


def naive_correction_metrics(old, mask, sampler, correction, bounds):
    """The correction's metrics one token at a time: the fractions of tokens truncated and masked, and the
    mean weight per token, with rho_t = pi_old / pi_sampler (1 where the sampler gave no log-prob) or, at
    sequence level, exp of its mean log over the sequence's tokens."""
    lo, hi = (0.0 if bounds[0] is None else bounds[0]), (math.inf if bounds[1] is None else bounds[1])
    truncated = masked = weight = tokens = 0.0
    for i in range(old.shape[0]):
        idx = mask[i].nonzero().flatten().tolist()
        log_rho = [0.0 if math.isnan(sampler[i, t]) else float(old[i, t] - sampler[i, t]) for t in idx]
        if correction.startswith("sequence") and idx:
            log_rho = [sum(log_rho) / len(log_rho)] * len(idx)
        for rho in map(math.exp, log_rho):
            outside = not lo <= rho <= hi
            tokens += 1
            if correction.endswith("truncate"):
                truncated += outside
                weight += min(max(rho, lo), hi)
            else:
                masked += outside
                weight += 0.0 if outside else rho
    return {
        "sampler_is_truncated_frac_token": truncated / tokens,
        "sampler_is_masked_frac_token": masked / tokens,
        "sampler_is_weight_mean": weight / tokens,
    }


def grad_of(loss, x):
    (g,) = torch.autograd.grad(loss, x, retain_graph=True)
    return g


def to_packed(logp, old, adv, mask, ref, seed=0, prompt_len=2):
    """Shuffle the rows, put a garbage 'prompt' before each, drop the padding: a packed stream."""
    B, T = mask.shape
    order = torch.randperm(B, generator=torch.Generator().manual_seed(seed)).tolist()
    ids, index = [], []
    for i in order:
        idx = mask[i].nonzero().flatten()
        ids += [torch.full((prompt_len,), -1), torch.full((len(idx),), i)]
        index += [torch.zeros(prompt_len, dtype=torch.long), i * T + idx]
    seg, take = torch.cat(ids), torch.cat(index)

    def pack(x):  # keep gradients flowing from the packed stream back to the padded leaf
        return torch.where(seg >= 0, x.reshape(-1)[take], float("nan"))

    p_adv = pack(adv) if adv.dim() == 2 else adv
    return pack(logp), pack(old), p_adv, seg, pack(ref)


# ---------------------------------------------------------------- hand-computed values
# float64 throughout: a handful of operations on O(1) values, each rounding by <= 2^-53 (1.1e-16) relative,
# leaves the loss within ~1e-15 of the hand value, so abs=1e-12 holds on any CPU; a wrong branch is >= 1e-2


def test_gspo_hand_values_both_clip_sides_both_signs():
    # five sequences with s_i = 1.1, 1.5, 0.5, 1.5, 0.5 (every token's log-ratio is log s_i)
    s = torch.tensor([1.1, 1.5, 0.5, 1.5, 0.5], dtype=torch.float64)
    adv = torch.tensor([2.0, 1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    lengths = torch.tensor([1, 2, 3, 2, 1])
    mask = torch.arange(3) < lengths[:, None]
    old = torch.full((5, 3), -1.0, dtype=torch.float64)
    logp = (old + torch.log(s)[:, None]).requires_grad_()
    # eps 0.2 / 0.3: L_i = -2.2 (inside), -1.3 (clipped high), 0.8 (clipped low), 1.5, -0.5 (unclipped)
    L = torch.tensor([-2.2, -1.3, 0.8, 1.5, -0.5], dtype=torch.float64)
    clipped = torch.tensor([False, True, True, False, False])
    for aggregation, expected in [
        ("seq-mean-token-mean", L.sum() / 5),
        ("token-mean", (lengths * L).sum() / 9),
        ("seq-mean-token-sum", (lengths * L).sum() / 5),
    ]:
        loss, m = gspo_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.3, aggregation=aggregation)
        assert loss.item() == pytest.approx(expected.item(), abs=1e-12)  # float64: ~1e-15, see above
        # dL/dlogp_t = -w_i A_i s_i / |y_i| on unclipped sequences, 0 on clipped ones and padding
        w = {"seq-mean-token-mean": 1 / 5, "token-mean": lengths / 9, "seq-mean-token-sum": lengths / 5}
        per_seq = torch.where(clipped, 0.0, -w[aggregation] * adv * s / lengths)
        torch.testing.assert_close(grad_of(loss, logp), torch.where(mask, per_seq[:, None], 0.0))
    assert m["clip_frac_seq"].item() == pytest.approx(2 / 5)
    assert m["clip_frac_seq_low"].item() == pytest.approx(1 / 5)
    assert m["clip_frac_seq_high"].item() == pytest.approx(1 / 5)
    assert m["clip_frac_token"].item() == pytest.approx(5 / 9)  # sequence 1 (2 tokens) + sequence 2 (3)
    assert m["clip_frac_token_high"].item() == pytest.approx(2 / 9)
    assert m["ratio_seq_min"].item() == pytest.approx(0.5)
    assert m["ratio_seq_max"].item() == pytest.approx(1.5)
    assert m["ratio_seq_mean"].item() == pytest.approx(1.0 + 0.1 / 5)
    assert m["log_ratio_abs_mean"].item() == pytest.approx(
        (math.log(1.1) + 2 * math.log(1.5) + 3 * math.log(2) + 2 * math.log(1.5) + math.log(2)) / 9
    )
    assert m["num_tokens"].item() == 9 and m["num_sequences"].item() == 5


def test_grpo_hand_values_per_token_clipping():
    r = torch.tensor([[1.1, 1.5, 0.5], [1.5, 0.5, 0.9], [1.0, 1.0, 1.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 5.0], dtype=torch.float64)
    mask = torch.tensor([[True] * 3, [True] * 3, [False] * 3])  # row 2 is empty: it counts in B only
    old = torch.zeros(3, 3, dtype=torch.float64)
    logp = torch.log(r).requires_grad_()
    loss, m = grpo_loss(logp, old, adv, mask)  # eps 0.2 / 0.27
    # row 0 (A=+1): -1.1, -1.27 (clipped high), -0.5;  row 1 (A=-1): 1.5, 0.8 (clipped low), 0.9
    expected = ((-1.1 - 1.27 - 0.5) / 3 + (1.5 + 0.8 + 0.9) / 3) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-12)  # float64: ~1e-15
    grad = torch.tensor([[-1.1, 0.0, -0.5], [1.5, 0.0, 0.9], [0.0, 0.0, 0.0]], dtype=torch.float64) / 9
    torch.testing.assert_close(grad_of(loss, logp), grad)
    assert m["clip_frac_token"].item() == pytest.approx(2 / 6)
    assert m["clip_frac_token_low"].item() == pytest.approx(1 / 6)
    assert m["clip_frac_seq"].item() == pytest.approx(1 / 3)  # mean of 1/3 and 1/3; the empty row is skipped
    assert m["clip_frac_seq_high"].item() == pytest.approx(1 / 6)
    assert m["ratio_token_max"].item() == pytest.approx(1.5)
    assert m["ratio_seq_min"].item() == pytest.approx((1.5 * 0.5 * 0.9) ** (1 / 3))
    assert m["num_sequences"].item() == 2 and m["num_seq_nonzero_adv"].item() == 2


def test_gspo_token_hand_values_per_token_advantages():
    # s = 1.5 for the sequence; tokens with A = +1 are clipped high, A = -1 are not
    logp = torch.full((1, 4), math.log(1.5), dtype=torch.float64).requires_grad_()
    old = torch.zeros(1, 4, dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, 1.0, -2.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, m = gspo_token_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.3)
    assert loss.item() == pytest.approx((-1.3 + 1.5 - 1.3 + 3.0) / 4, abs=1e-12)  # float64: ~1e-15
    # d s_i,t / d logp_t = s_i: only the unclipped tokens' own log-prob gets a gradient
    torch.testing.assert_close(
        grad_of(loss, logp), torch.tensor([[0.0, 1.5, 0.0, 3.0]], dtype=torch.float64) / 4
    )
    assert m["clip_frac_token_high"].item() == pytest.approx(0.5)
    assert m["clip_frac_seq"].item() == pytest.approx(0.5)
    assert m["num_seq_nonzero_adv"].item() == 1


def test_gmpo_hand_values_clip_in_log_space_then_geometric_mean():
    # sequence 0 (A = +1): log r = 0.5 (clipped to 0.4), 0.1;  sequence 1 (A = -2): -0.6 (clipped to -0.4), 0.3
    log_r = torch.tensor([[0.5, 0.1], [-0.6, 0.3]], dtype=torch.float64)
    logp = log_r.clone().requires_grad_()
    old, adv, mask = (
        torch.zeros(2, 2, dtype=torch.float64),
        torch.tensor([1.0, -2.0]),
        torch.ones(2, 2).bool(),
    )
    loss, m = OBJECTIVES["gmpo"](logp, old, adv, mask)  # paper default: [-0.4, 0.4]
    g0, g1 = math.exp((0.4 + 0.1) / 2), math.exp((-0.4 + 0.3) / 2)
    assert loss.item() == pytest.approx((-1 * g0 + 2 * g1) / 2, abs=1e-12)  # float64: ~1e-15
    # dL/dlogp_t = -A_i g_i / |y_i| / B on unclipped tokens, 0 on clipped ones
    grad = torch.tensor([[0.0, -g0 / 2], [0.0, 2 * g1 / 2]], dtype=torch.float64) / 2
    torch.testing.assert_close(grad_of(loss, logp), grad)
    assert m["clip_frac_token"].item() == pytest.approx(0.5)
    assert m["clip_frac_token_high"].item() == pytest.approx(0.25)
    assert m["clip_frac_token_low"].item() == pytest.approx(0.25)
    assert m["clip_frac_seq"].item() == pytest.approx(0.5)


def test_sapo_hand_values_soft_gate():
    sig = torch.sigmoid
    # row 0 (A = +1, tau 1.0): r = 1 (gate value 2, weight 1), r = 4 (weight 4 s(3) s(-3) = 0.18 < 1/2: gated)
    # row 1 (A = -1, tau 1.05): r = 0.5 (weight 0.93: not gated)
    r = torch.tensor([[1.0, 4.0], [0.5, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True], [True, False]])
    logp = torch.log(r).requires_grad_()
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, m = OBJECTIVES["sapo"](logp, torch.zeros(2, 2, dtype=torch.float64), adv, mask)
    t = torch.tensor(3.0, dtype=torch.float64)
    x1 = torch.tensor(1.05 * (0.5 - 1), dtype=torch.float64)
    f = [2.0, float(sig(t) * 4), float(sig(x1) * 4 / 1.05)]
    assert loss.item() == pytest.approx(((-f[0] - f[1]) / 2 + f[2]) / 2, abs=1e-12)  # float64: ~1e-15
    # dL/dlogp_t = -A f'(r) r, f'(r) = 4 s(x) s(-x), x = tau (r - 1)
    w = [1.0, float(4 * sig(t) * sig(-t)) * 4, float(4 * sig(x1) * sig(-x1)) * 0.5]
    grad = torch.tensor([[-w[0] / 2, -w[1] / 2], [w[2], 0.0]], dtype=torch.float64) / 2
    torch.testing.assert_close(grad_of(loss, logp), grad)
    assert m["clip_frac_token_high"].item() == pytest.approx(1 / 3) and m["clip_frac_token_low"].item() == 0
    # the sequence level gates s_i = exp(mean log r) instead: row 0 has s = 2, weight 4 s(1) s(-1) = 0.79
    seq_loss, m = OBJECTIVES["sapo_seq"](logp, torch.zeros(2, 2, dtype=torch.float64), adv, mask)
    f_seq = [float(sig(torch.tensor(1.0, dtype=torch.float64)) * 4), float(sig(x1) * 4 / 1.05)]
    assert seq_loss.item() == pytest.approx((-f_seq[0] + f_seq[1]) / 2, abs=1e-12)  # float64: ~1e-15
    assert m["clip_frac_seq"].item() == 0.0


def test_cispo_hand_values_truncated_tokens_keep_their_gradient():
    r = torch.tensor([[1.1, 6.0, 0.5]], dtype=torch.float64)
    old = torch.full((1, 3), -1.0, dtype=torch.float64)
    logp = (old + torch.log(r)).requires_grad_()
    loss, m = OBJECTIVES["cispo"](logp, old, torch.tensor([2.0]), torch.ones(1, 3).bool())  # weight in [0, 5]
    w = torch.tensor([[1.1, 5.0, 0.5]], dtype=torch.float64)
    # float64: ~1e-15
    assert loss.item() == pytest.approx(float(-(w * 2 * logp.detach()).sum() / 3), abs=1e-12)
    torch.testing.assert_close(grad_of(loss, logp), -w * 2 / 3)  # -sg[w] A: no token loses its gradient
    assert m["clip_frac_token_high"].item() == pytest.approx(1 / 3) and m["clip_frac_token_low"].item() == 0


def test_dr_grpo_and_luspo_aggregations_by_hand():
    # Dr. GRPO: token sums over B x a constant; LUSPO: GSPO's L_i times |y_i|, over B
    r = torch.tensor([[1.1, 1.0, 1.0], [0.9, 1.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    logp, adv = torch.log(r).requires_grad_(), torch.tensor([1.0, -1.0], dtype=torch.float64)
    old = torch.zeros(2, 3, dtype=torch.float64)
    loss, _ = grpo_loss(logp, old, adv, mask, aggregation="seq-mean-token-sum-norm", normalizer=2 * 10)
    assert loss.item() == pytest.approx((-(1.1 + 1 + 1) + 0.9) / 20, abs=1e-12)  # float64: ~1e-15
    with pytest.raises(ValueError, match=r"Dr\. GRPO.*pass normalizer"):
        policy_loss("grpo", logp, old, adv, mask, aggregation="seq-mean-token-sum-norm")
    loss, _ = gspo_loss(logp, old, adv, mask, aggregation="seq-mean-token-sum", eps_low=1.0, eps_high=1.0)
    s0, s1 = 1.1 ** (1 / 3), 0.9
    assert loss.item() == pytest.approx((3 * -s0 + 1 * s1) / 2, abs=1e-12)  # float64: ~1e-15


def test_corrections_hand_values():
    # one on-policy GRPO sequence (A = 1, L_t = -1) and rho_t = pi_old / pi_sampler = 3, 0.25
    logp = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    sampler = torch.log(torch.tensor([[1 / 3, 4.0]], dtype=torch.float64))
    args = (logp, logp.detach(), torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2).bool())
    rho_seq = math.sqrt(0.75)  # exp(mean log rho_t)
    for correction, weights, truncated, masked in [
        ("token_truncate", [2.0, 0.25], 0.5, 0.0),  # default (none, 2)
        ("token_mask", [3.0, 0.0], 0.0, 0.5),  # default [0.5, 5]
        ("sequence_truncate", [rho_seq] * 2, 0.0, 0.0),
        ("sequence_mask", [rho_seq] * 2, 0.0, 0.0),
    ]:
        loss, m = grpo_loss(*args, sampler_logp=sampler, sampler_correction=correction)
        assert loss.item() == pytest.approx(-sum(weights) / 2, abs=1e-12), correction  # float64: ~1e-15
        torch.testing.assert_close(grad_of(loss, logp), -torch.tensor([weights], dtype=torch.float64) / 2)
        assert m["sampler_is_truncated_frac_token"].item() == pytest.approx(truncated)
        assert m["sampler_is_masked_frac_token"].item() == pytest.approx(masked)
        assert m["sampler_is_weight_mean"].item() == pytest.approx(sum(weights) / 2)
    bounds = dict(sampler_correction_min=0.9, sampler_correction_max=2.0)
    loss, m = grpo_loss(*args, sampler_logp=sampler, sampler_correction="sequence_mask", **bounds)
    assert loss.item() == 0.0 and m["sampler_is_masked_frac_seq"].item() == 1.0  # 0.866 < 0.9: dropped
    # a NaN sampler log-prob is unknown: ratio 1
    nan_first = torch.tensor([[float("nan"), 0.0]])
    loss, _ = grpo_loss(*args, sampler_logp=nan_first, sampler_correction="token_truncate")
    assert loss.item() == pytest.approx(-1.0)


def test_opsm_drops_negative_sequences_that_drifted_from_the_sampler():
    # KL_i = mean_t (log pi_sampler - log pi_theta) = 1 for both sequences; only A < 0 is dropped
    logp = torch.full((2, 2), -1.0, dtype=torch.float64, requires_grad=True)
    sampler = torch.zeros(2, 2, dtype=torch.float64)
    adv, mask = torch.tensor([1.0, -1.0], dtype=torch.float64), torch.ones(2, 2).bool()
    for delta, dropped in [(0.5, True), (1.5, False)]:
        loss, m = grpo_loss(logp, logp.detach(), adv, mask, sampler_logp=sampler, opsm_delta=delta)
        expected = -1.0 / 2 if dropped else 0.0  # sequence 0: -1; sequence 1: +1 unless dropped
        assert loss.item() == pytest.approx(expected), delta
        assert m["opsm_masked_frac_seq"].item() == (0.5 if dropped else 0.0)
        assert (grad_of(loss, logp)[1] == 0).all() == dropped
    # without sampler log-probs OPSM measures against old_logp (old_logprobs="sampler": the sampler's)
    loss, m = gspo_loss(logp, sampler, adv, mask, opsm_delta=0.5)
    assert m["opsm_masked_frac_seq"].item() == 0.5


def test_correction_errors_name_the_fix():
    logp, old, adv, mask, _ = make_batch(15, B=2, T=3)
    with pytest.raises(ValueError, match="use sequence_mask"):
        gspo_loss(logp, old, adv, mask, sampler_logp=old, sampler_correction="token_mask")
    with pytest.raises(ValueError, match="needs sampler_logp"):
        policy_loss("grpo", logp, old, adv, mask, sampler_correction="token_mask")
    with pytest.raises(ValueError, match="unknown correction 'icepop'"):
        grpo_loss(logp, old, adv, mask, sampler_logp=old, sampler_correction="icepop")
    with pytest.raises(ValueError, match="0 <= C_min <= C_max"):
        bounds = dict(sampler_correction_min=2, sampler_correction_max=1)
        grpo_loss(logp, old, adv, mask, sampler_logp=old, sampler_correction="token_mask", **bounds)
    with pytest.raises(ValueError, match="bound a correction: set sampler_correction too"):
        policy_loss("grpo", logp, old, adv, mask, sampler_correction_min=0.5, sampler_correction_max=2)
    with pytest.raises(ValueError, match="tau_pos is not a knob of grpo"):
        policy_loss("grpo", logp, old, adv, mask, tau_pos=1.0)
    with pytest.raises(ValueError, match="eps_low is not a knob of sapo; its knobs are tau_pos, tau_neg"):
        policy_loss("sapo", logp, old, adv, mask, eps_low=0.2)
    with pytest.raises(ValueError, match="gmpo takes one advantage per sequence"):
        policy_loss("gmpo", logp, old, torch.ones(2, 3), mask)


def test_kl_hand_value():
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.zeros(1, dtype=torch.float64)
    loss, m = grpo_loss(logp, logp.detach(), adv, mask, ref_logp=ref, beta=0.5)
    k3 = [math.exp(d) - d - 1 for d in (-0.5, 1.0)]
    assert m["kl"].item() == pytest.approx(sum(k3) / 2)
    assert m["loss"].item() == 0.0
    assert loss.item() == pytest.approx(0.5 * sum(k3) / 2)


# ---------------------------------------------------------------- against the naive loop


@FAST
@given(
    kind=st.sampled_from(KINDS),
    aggregation=st.sampled_from(AGGREGATIONS),
    seed=st.integers(0, 10_000),
    B=st.integers(1, 5),
    T=st.integers(1, 7),
    eps=st.sampled_from([(3e-4, 4e-4), (0.2, 0.27), (0.05, 0.1)]),
    with_kl=st.booleans(),
    per_token_adv=st.booleans(),
)
def test_matches_naive_loop(kind, aggregation, seed, B, T, eps, with_kl, per_token_adv):
    per_token_adv = per_token_adv and kind not in SEQUENCE_OBJECTIVES
    logp, old, adv, mask, ref = make_batch(seed, B, T, per_token_adv=per_token_adv, dtype=torch.float64)
    ref = ref if with_kl else None
    kwargs = dict(eps_low=eps[0], eps_high=eps[1], aggregation=aggregation, ref_logp=ref, beta=0.1)
    loss, _ = OBJECTIVES[kind](logp, old, adv, mask, **kwargs)
    tau = (0.2 / eps[1], 0.3 / eps[0])  # knobs(): SAPO's temperatures for this clip range
    expected = naive_loss(kind, logp, old, adv, mask, eps[0], eps[1], aggregation, ref, 0.1, tau=tau)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad_of(loss, logp), grad_of(expected, logp))


@FAST
@given(
    kind=st.sampled_from(KINDS),
    correction=st.sampled_from([None, "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]),
    bounds=st.sampled_from([None, (0.9, 1.1), (None, 1.05), (0.97, None)]),
    opsm_delta=st.sampled_from([None, 0.0, 0.05]),
    aggregation=st.sampled_from(AGGREGATIONS),
    seed=st.integers(0, 10_000),
    unknown=st.booleans(),
)
def test_corrections_match_naive_loop(kind, correction, bounds, opsm_delta, aggregation, seed, unknown):
    if kind in SEQUENCE_OBJECTIVES and correction is not None and correction.startswith("token"):
        correction = correction.replace("token", "sequence")  # the only level a sequence objective takes
    if correction is None:
        correction, bounds = "none", None
    logp, old, adv, mask, _ = make_batch(seed, B=5, T=6, spread=0.1, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed + 1)
    sampler = old + 0.1 * torch.randn(old.shape, generator=g, dtype=torch.float64)
    if unknown:  # tokens the sampler reported no log-prob for: ratio 1
        sampler = torch.where(torch.rand(old.shape, generator=g) < 0.3, float("nan"), sampler)
    kwargs = dict(
        aggregation=aggregation, sampler_logp=sampler, sampler_correction=correction, opsm_delta=opsm_delta
    )
    if bounds is not None:  # None on one side: unbounded there (rho >= 0 always, and finite)
        low, high = bounds
        kwargs |= dict(sampler_correction_min=low or 0.0, sampler_correction_max=high or math.inf)
    loss, m = OBJECTIVES[kind](logp, old, adv, mask, **kwargs)
    default = PAPER_DEFAULTS[kind]
    if correction != "none" and bounds is None:
        from gspo.core.registry import CORRECTION_BOUNDS

        bounds = CORRECTION_BOUNDS[correction]
    expected = naive_loss(
        kind,
        logp,
        old,
        adv,
        mask,
        default.get("eps_low"),
        default.get("eps_high"),
        aggregation,
        tau=(default.get("tau_pos"), default.get("tau_neg")),
        sampler=sampler,
        correction=None if correction == "none" else correction,
        bounds=bounds or (None, None),
        opsm_delta=opsm_delta,
    )
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad_of(loss, logp), grad_of(expected, logp))
    if correction != "none":
        naive = naive_correction_metrics(old, mask, sampler, correction, bounds)
        for key, value in naive.items():
            assert m[key].item() == pytest.approx(value, rel=1e-6, abs=1e-12), key


# ---------------------------------------------------------------- identities


@FAST
@given(aggregation=st.sampled_from(AGGREGATIONS), seed=st.integers(0, 10_000), broadcast=st.booleans())
def test_gspo_token_equals_gspo_with_sequence_advantages(aggregation, seed, broadcast):
    logp, old, adv, mask, ref = make_batch(seed, B=5, T=6, spread=0.01)
    token_adv = adv[:, None].expand(mask.shape) if broadcast else adv
    kwargs = dict(aggregation=aggregation, ref_logp=ref, beta=0.05)
    loss_s, m_s = gspo_loss(logp, old, adv, mask, **kwargs)
    loss_t, m_t = gspo_token_loss(logp, old, token_adv, mask, **kwargs)
    torch.testing.assert_close(loss_t, loss_s)
    torch.testing.assert_close(grad_of(loss_t, logp), grad_of(loss_s, logp))
    for key in m_s:
        torch.testing.assert_close(m_t[key], m_s[key], msg=key)


@pytest.mark.parametrize("seed", range(5))
def test_on_policy_every_objective_has_grpos_gradient(seed):
    logp, _, adv, mask, _ = make_batch(seed, B=6, T=8)
    old = logp.detach()  # on-policy: ratios are 1 in value, not in gradient
    loss_grpo, _ = grpo_loss(logp, old, adv, mask)
    assert grad_of(loss_grpo, logp).abs().sum() > 0
    for kind in KINDS:  # clip, geometric mean, soft gate (f'(1) = 1) and CISPO's weight 1: -A_i / |y_i| / B
        loss, _ = OBJECTIVES[kind](logp, old, adv, mask)
        torch.testing.assert_close(grad_of(loss, logp), grad_of(loss_grpo, logp), msg=kind)
        if kind in ("gspo", "gspo_token", "gmpo"):  # the same value too: -mean_i A_i
            torch.testing.assert_close(loss, loss_grpo)


@pytest.mark.parametrize(
    ("kind", "per_token_adv", "correction"),
    [(kind, False, None) for kind in KINDS]
    + [(kind, True, None) for kind in KINDS if kind not in SEQUENCE_OBJECTIVES]
    + [("gspo", False, "sequence_mask"), ("gmpo", False, "sequence_truncate"), ("grpo", True, "token_mask")]
    + [("cispo", False, "token_truncate"), ("sapo", True, "sequence_mask")],
)
def test_packed_equals_padded(kind, per_token_adv, correction):
    logp, old, adv, mask, ref = make_batch(3, B=5, T=7, spread=0.2, per_token_adv=per_token_adv, empty_row=2)
    sampler = old + 0.1 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1), dtype=old.dtype)
    p_sampler = to_packed(logp, sampler, adv, mask, ref)[1]
    kwargs = dict(eps_low=0.05, eps_high=0.08, ref_logp=ref, beta=0.1)
    if correction is not None:
        kwargs |= dict(sampler_correction=correction, opsm_delta=0.02)
        kwargs |= dict(sampler_correction_min=0.95, sampler_correction_max=1.05)
    for aggregation in AGGREGATIONS:
        loss, m = OBJECTIVES[kind](
            logp,
            old,
            adv,
            mask,
            aggregation=aggregation,
            sampler_logp=sampler if correction else None,
            **kwargs,
        )
        p_logp, p_old, p_adv, seg, p_ref = to_packed(logp, old, adv, mask, ref)
        kwargs["ref_logp"] = p_ref
        p_loss, p_m = PACKED_OBJECTIVES[kind](
            p_logp,
            p_old,
            p_adv,
            seg,
            5,
            aggregation=aggregation,
            sampler_logp=p_sampler if correction else None,
            **kwargs,
        )
        kwargs["ref_logp"] = ref
        torch.testing.assert_close(p_loss, loss)
        assert p_m.keys() == m.keys()
        for key in m:
            torch.testing.assert_close(p_m[key], m[key], msg=key)
        torch.testing.assert_close(grad_of(p_loss, logp), grad_of(loss, logp))


@pytest.mark.parametrize("kind", KINDS)
def test_padding_gets_exactly_zero_gradient_even_with_nan(kind):
    logp, old, adv, mask, ref = make_batch(4, B=4, T=6)
    assert torch.isnan(logp[~mask]).all()  # make_batch fills the padding with NaN
    old = torch.where(mask, old, float("inf"))
    loss, m = OBJECTIVES[kind](logp, old, adv, mask, ref_logp=ref, beta=0.1)
    grad = grad_of(loss, logp)
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in m.values())
    assert (grad[~mask] == 0).all() and torch.isfinite(grad).all()
    clean = [torch.where(mask, x.detach(), 0.0) for x in (logp, old, ref)]
    clean_logp = clean[0].requires_grad_()
    clean_loss, _ = OBJECTIVES[kind](clean_logp, clean[1], adv, mask, ref_logp=clean[2], beta=0.1)
    torch.testing.assert_close(loss, clean_loss)
    torch.testing.assert_close(grad, grad_of(clean_loss, clean_logp))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_minibatch_accumulation_equals_full_batch(kind, aggregation):
    logp, old, adv, mask, ref = make_batch(5, B=6, T=7, spread=0.05, dtype=torch.float64)
    sampler = old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(2), dtype=old.dtype)
    correction = "sequence_truncate" if kind in SEQUENCE_OBJECTIVES else "token_mask"
    kwargs = dict(eps_low=0.02, eps_high=0.03, aggregation=aggregation, ref_logp=ref, beta=0.1)
    kwargs |= dict(sampler_correction=correction, opsm_delta=0.01)
    kwargs |= dict(sampler_correction_min=0.97, sampler_correction_max=1.03)
    full, _ = OBJECTIVES[kind](logp, old, adv, mask, sampler_logp=sampler, **kwargs)
    normalizer = {"token-mean": mask.sum(), "seq-mean-token-sum-norm": 6 * NORM_TOKENS}.get(aggregation, 6)
    total = 0
    for rows in (slice(0, 2), slice(2, 4), slice(4, 6)):
        kwargs["ref_logp"] = ref[rows]
        part, _ = OBJECTIVES[kind](
            logp[rows],
            old[rows],
            adv[rows],
            mask[rows],
            normalizer=normalizer,
            sampler_logp=sampler[rows],
            **kwargs,
        )
        total = total + part
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(grad_of(total, logp), grad_of(full, logp))


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "cispo"])  # CISPO's stop-gradient: by hand below
def test_gradcheck_float64(kind):
    # log-ratios in {+-0.05, +-0.5}: far from the kinks at 1 - 0.2 and 1 + 0.27 (and the sequence means too)
    g = torch.Generator().manual_seed(0)
    B, T = 3, 4
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5
    steps = torch.tensor([0.05, -0.05, 0.5, -0.5], dtype=torch.float64)
    logp = (old + steps[torch.randint(0, 4, (B, T), generator=g)]).requires_grad_()
    seq_ratio = (torch.where(mask, logp - old, 0.0).sum(1) / mask.sum(1)).exp()
    assert ((seq_ratio - 0.8).abs() > 1e-2).all() and ((seq_ratio - 1.27).abs() > 1e-2).all()
    adv = torch.tensor([1.0, -0.7, 0.4], dtype=torch.float64)
    ref = old + 0.1
    for aggregation in AGGREGATIONS:

        def f(x, aggregation=aggregation):
            return OBJECTIVES[kind](
                x, old, adv, mask, eps_low=0.2, eps_high=0.27, aggregation=aggregation, ref_logp=ref, beta=0.3
            )[0]

        assert torch.autograd.gradcheck(f, (logp,))


# ---------------------------------------------------------------- numerics


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_inputs_accumulate_in_fp32(kind):
    # long sequences: bf16 arithmetic anywhere on the bf16 path (rounding by 2^-8 where fp32 rounds by 2^-24)
    # shows as a difference from the same loss on the bf16 values upcast to fp32 first, compared exactly
    g = torch.Generator().manual_seed(6)
    old16 = (-3 * torch.rand(3, 2048, generator=g)).to(torch.bfloat16)
    logp16 = (old16.float() + 0.01 * torch.randn(3, 2048, generator=g)).to(torch.bfloat16).requires_grad_()
    adv, mask = torch.tensor([1.0, -0.5, 0.3]), torch.ones(3, 2048, dtype=torch.bool)
    loss16, m16 = OBJECTIVES[kind](logp16, old16, adv, mask, eps_low=0.2, eps_high=0.27)
    logp32 = logp16.detach().float().requires_grad_()
    loss32, m32 = OBJECTIVES[kind](logp32, old16.float(), adv, mask, eps_low=0.2, eps_high=0.27)
    assert loss16.dtype == torch.float32
    # exact by design: the bf16 inputs are upcast (exactly) before any arithmetic, then both run the same
    # fp32 kernels on the same values and shapes
    torch.testing.assert_close(loss16, loss32, rtol=0, atol=0)
    assert m16["ratio_seq_mean"] == m32["ratio_seq_mean"]
    grad16 = grad_of(loss16, logp16)
    assert grad16.dtype == torch.bfloat16
    # exact by design: the upcast's backward is the fp32 gradient cast to bf16, the same cast as here
    torch.testing.assert_close(grad16, grad_of(loss32, logp32).to(torch.bfloat16), rtol=0, atol=0)
    logp64 = logp16.detach().double()
    tau = (0.2 / 0.27, 0.3 / 0.2)  # knobs(): SAPO's temperatures for this clip range
    expected = naive_loss(
        kind, logp64, old16.double(), adv.double(), mask, 0.2, 0.27, "seq-mean-token-mean", tau=tau
    )
    # fp32 against float64: the token-level kinds sum 6144 terms, off by <= n*u*sum|x|/|sum x| = 6144 * 2^-24 *
    # 2.3 = 8e-4 in any order (sequence-level ones ~1e-6); a formula bug is >= 1e-2 (bf16 arithmetic: above)
    assert loss16.item() == pytest.approx(expected.item(), rel=1e-3)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_extreme_log_ratios_are_finite(kind, sign):
    logp, old, _, mask, _ = make_batch(7, B=4, T=5)
    logp = torch.where(mask, old + sign * 1e4, float("nan")).detach().requires_grad_()
    for adv in (torch.ones(4), -torch.ones(4)):
        loss, m = OBJECTIVES[kind](logp, old, adv, mask, ref_logp=old - sign * 1e4, beta=0.1)
        grad = grad_of(loss, logp)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        assert all(torch.isfinite(v) for v in m.values())
        assert m["ratio_token_max"].item() == pytest.approx(math.exp(20 * sign), rel=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_empty_sequence_contributes_zero(kind):
    logp, old, adv, mask, _ = make_batch(8, B=4, T=5, empty_row=1)
    adv = adv.clone()
    adv[1] = float("nan")  # never read: row 1 has no valid token
    loss, m = OBJECTIVES[kind](logp, old, adv, mask)
    keep = [0, 2, 3]
    sub, _ = OBJECTIVES[kind](logp[keep], old[keep], adv[keep], mask[keep])
    # the empty row still counts in B (the paper's G): loss = (3/4) * loss over the other three
    torch.testing.assert_close(loss, sub * 3 / 4)
    grad = grad_of(loss, logp)
    assert (grad[1] == 0).all()
    assert m["num_sequences"].item() == 3 and m["num_seq_nonzero_adv"].item() == 3
    tok, _ = OBJECTIVES[kind](logp, old, adv, mask, aggregation="token-mean")
    tok_sub, _ = OBJECTIVES[kind](logp[keep], old[keep], adv[keep], mask[keep], aggregation="token-mean")
    torch.testing.assert_close(tok, tok_sub)


@pytest.mark.parametrize("kind", KINDS)
def test_empty_batch_gives_zeros(kind):
    """Zeros, except the extremes: their identities (+inf for *_min, -inf for *_max), which reduce_metrics
    leaves out."""
    identity = {"_min": math.inf, "_max": -math.inf}
    for B, T in [(0, 4), (3, 4), (2, 0)]:
        logp = torch.full((B, T), float("nan"), requires_grad=True)
        mask = torch.zeros(B, T, dtype=torch.bool)
        loss, m = OBJECTIVES[kind](
            logp, logp.detach(), torch.zeros(B), mask, ref_logp=logp.detach(), beta=0.1
        )
        loss.backward()
        assert loss.item() == 0.0
        assert set(m) == METRIC_KEYS | {"kl"}
        assert {k: v.item() for k, v in m.items()} == {k: identity.get(k[-4:], 0.0) for k in m}
        assert (logp.grad == 0).all()


@pytest.mark.parametrize("kind", KINDS)
def test_metrics_are_detached_float_scalars(kind):
    logp, old, adv, mask, _ = make_batch(9)
    _, m = OBJECTIVES[kind](logp, old, adv, mask)
    assert set(m) == METRIC_KEYS
    for v in m.values():
        assert v.shape == () and v.dtype == torch.float32 and not v.requires_grad


class CountHostSyncs(TorchDispatchMode):
    """Counts tensor -> Python scalar reads (.item(), bool(t)): the host syncs on an accelerator."""

    def __init__(self):
        super().__init__()
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.syncs += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", KINDS)
def test_only_the_finite_check_syncs(kind):
    logp, old, adv, mask, ref = make_batch(14)
    p_logp, p_old, p_adv, seg, p_ref = to_packed(logp, old, adv, mask, ref)
    correction = "sequence_mask" if kind in SEQUENCE_OBJECTIVES else "token_truncate"
    fix = dict(ref_logp=ref, beta=0.1, sampler_logp=ref, sampler_correction=correction, opsm_delta=0.1)
    for check_finite, expected in [(False, 0), (True, 1)]:
        with CountHostSyncs() as counter:
            loss, _ = OBJECTIVES[kind](logp, old, adv, mask, check_finite=check_finite, **fix)
            grad_of(loss, logp)
        assert counter.syncs == expected
        with CountHostSyncs() as counter:
            fn = PACKED_OBJECTIVES[kind]
            packed = fix | dict(ref_logp=p_ref, sampler_logp=p_ref)
            loss, _ = fn(p_logp, p_old, p_adv, seg, 4, check_finite=check_finite, **packed)
            grad_of(loss, logp)
        assert counter.syncs == expected


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("tensor", "value", "where"),
    [("logp", float("nan"), (1, 2)), ("old_logp", float("-inf"), (0, 0)), ("ref_logp", float("inf"), (2, 1))],
)
def test_nonfinite_at_valid_position_names_tensor_and_position(kind, tensor, value, where):
    logp, old, adv, mask, ref = make_batch(10, B=3, T=4)
    mask[:] = True
    inputs = {"logp": logp.detach(), "old_logp": old, "ref_logp": ref}
    inputs = {k: torch.nan_to_num(v, nan=-1.0) for k, v in inputs.items()}  # make_batch's padding is NaN
    inputs[tensor][2, 3] = value  # a second, later bad value: the first one is reported
    inputs[tensor][where] = value
    fn = OBJECTIVES[kind]
    with pytest.raises(
        ValueError, match=rf"policy_loss\({kind}\): {tensor} is .* \(row {where[0]}, col {where[1]}\).*Hint"
    ):
        fn(inputs["logp"], inputs["old_logp"], adv, mask, ref_logp=inputs["ref_logp"])
    mask[where] = False  # the same value outside the mask is fine
    inputs[tensor][2, 3] = 0.0
    fn(inputs["logp"], inputs["old_logp"], adv, mask, ref_logp=inputs["ref_logp"])


def test_nonfinite_advantages_named():
    logp, old, adv, mask, _ = make_batch(11, B=3, T=4)
    bad = adv.clone()
    bad[2] = float("nan")
    with pytest.raises(
        ValueError, match=r"policy_loss\(gspo\): advantages is nan at valid position \(row 2\)"
    ):
        gspo_loss(logp, old, bad, mask)
    token_adv = torch.ones(3, 4)
    token_adv[1, 0] = float("inf")
    with pytest.raises(
        ValueError, match=r"policy_loss\(grpo\): advantages is inf at valid position \(row 1, col 0\)"
    ):
        grpo_loss(logp, old, token_adv, mask)
    gspo_loss(logp, old, bad, mask, check_finite=False)  # the check can be turned off


def test_packed_errors_name_index_and_segment():
    seg = torch.tensor([-1, 0, 0, -1, 1, 1])
    logp = torch.zeros(6)
    logp[4] = float("nan")
    with pytest.raises(ValueError, match=r"policy_loss\(gspo\): logp is nan at valid position index 4"):
        gspo_loss_packed(logp, torch.zeros(6), torch.zeros(2), seg, 2)
    logp[4] = 0.0
    logp[0] = float("nan")  # a prompt token: ignored
    with pytest.raises(
        ValueError, match=r"policy_loss\(grpo\): advantages is nan at valid position segment 1"
    ):
        grpo_loss_packed(logp, torch.zeros(6), torch.tensor([0.0, float("nan")]), seg, 2)
    with pytest.raises(ValueError, match=r"segment_ids\[4\] = 2 is out of range for num_segments=2"):
        gspo_loss_packed(logp, torch.zeros(6), torch.zeros(2), torch.tensor([-1, 0, 0, -1, 2, 2]), 2)


def test_bad_arguments():
    logp, old, adv, mask, _ = make_batch(12, B=2, T=3)
    with pytest.raises(ValueError, match="unknown aggregation 'sum'"):
        gspo_loss(logp, old, adv, mask, aggregation="sum")
    with pytest.raises(ValueError, match="use objective gspo_token for per-token ones"):
        gspo_loss(logp, old, torch.ones(2, 3), mask)
    with pytest.raises(ValueError, match="must share one"):
        grpo_loss(logp, old[:, :2], adv, mask)
    with pytest.raises(ValueError, match="mask must be bool"):
        grpo_loss(logp, old, adv, mask.float())
    with pytest.raises(ValueError, match=r"advantages must be \(2,\) or \(2, 3\)"):
        grpo_loss(logp, old, torch.ones(3), mask)
    with pytest.raises(ValueError, match="normalizer must be positive"):
        grpo_loss(logp, old, adv, mask, normalizer=0)


# ---------------------------------------------------------------- sequence parallelism


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "gmpo"])  # GMPO refuses (test below)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_two_rank_sequence_parallel_split_sums_to_unsplit(kind, aggregation):
    logp, old, adv, mask, ref = make_batch(13, B=4, T=6, spread=0.05, dtype=torch.float64, empty_row=3)
    p_logp, p_old, p_adv, seg, p_ref = to_packed(logp, old, adv, mask, ref, prompt_len=1)
    kwargs = dict(eps_low=0.01, eps_high=0.02, aggregation=aggregation, beta=0.2)
    fn = PACKED_OBJECTIVES[kind]
    loss, m = fn(p_logp, p_old, p_adv, seg, 4, ref_logp=p_ref, **kwargs)
    if kind not in ("sapo", "sapo_seq"):  # SAPO's gate keeps over half the weight at these ratios
        assert 0 < m["clip_frac_token"] < 1  # both clipped and unclipped terms are exercised

    # cut inside a segment: its tokens live on both "ranks"
    inside = [c for c in range(1, len(seg)) if seg[c - 1] == seg[c] >= 0]
    cut = inside[len(inside) // 2]
    parts = [slice(0, cut), slice(cut, None)]

    def local_sums(p):  # what the other rank contributes to the all-reduce, in the same autograd graph
        valid = seg[p] >= 0
        bucket = torch.where(valid, seg[p], 4)
        lr = torch.where(valid, p_logp[p] - p_old[p], 0.0)
        z = torch.zeros(5, dtype=torch.float64)
        return torch.stack([z.index_add(0, bucket, lr), z.index_add(0, bucket, valid.double())])[:, :4]

    total, rank_metrics = 0, []
    for r, p in enumerate(parts):
        other = parts[1 - r]

        def all_reduce(sums, other=other):
            return sums + local_sums(other)

        part_loss, part_m = fn(
            p_logp[p], p_old[p], p_adv, seg[p], 4, ref_logp=p_ref[p], segment_sum_reduce=all_reduce, **kwargs
        )
        total = total + part_loss
        rank_metrics.append(part_m)
    torch.testing.assert_close(total, loss)
    torch.testing.assert_close(grad_of(total, logp), grad_of(loss, logp))
    m0, m1 = rank_metrics
    torch.testing.assert_close(m0["loss"] + m1["loss"], m["loss"])
    torch.testing.assert_close(m0["kl"] + m1["kl"], m["kl"])
    torch.testing.assert_close(m0["num_tokens"] + m1["num_tokens"], m["num_tokens"])
    for key in ("ratio_seq_mean", "ratio_seq_min", "ratio_seq_max", "num_sequences"):  # global on every rank
        torch.testing.assert_close(m0[key], m[key], msg=key)
        torch.testing.assert_close(m1[key], m[key], msg=key)
    n0, n1 = m0["num_tokens"], m1["num_tokens"]
    for key in ("clip_frac_token", "clip_frac_token_low", "ratio_token_mean", "log_ratio_abs_mean"):
        torch.testing.assert_close((m0[key] * n0 + m1[key] * n1) / (n0 + n1), m[key], msg=key)
    if kind in ("gspo", "sapo_seq"):
        torch.testing.assert_close(m0["clip_frac_seq"], m["clip_frac_seq"])


def test_sequence_parallel_refuses_what_needs_more_all_reduces():
    logp, old, adv, mask, _ = make_batch(13, B=3, T=4)
    p_logp, p_old, _, seg, _ = to_packed(logp, old, adv, mask, old)
    with pytest.raises(ValueError, match="supports neither gmpo nor the mismatch corrections"):
        compute_loss(LossSpec("gmpo"), LossInputs(p_logp, p_old, adv, seg, 3), segment_sum_reduce=lambda x: x)
    with pytest.raises(ValueError, match="supports neither gmpo nor the mismatch corrections"):
        spec = LossSpec("grpo", opsm_delta=0.1)
        compute_loss(spec, LossInputs(p_logp, p_old, adv, seg, 3), segment_sum_reduce=lambda x: x)


def test_objective_names_defaults_and_entry_point_errors():
    assert KINDS == ("gspo", "gspo_token", "grpo", "gmpo", "sapo", "sapo_seq", "cispo")
    assert PAPER_CLIP == {
        "gspo": (3e-4, 4e-4),
        "gspo_token": (3e-4, 4e-4),
        "grpo": (0.2, 0.27),
        "gmpo": (0.4, 0.4),
        "cispo": (1.0, 4.0),
    }
    assert PAPER_DEFAULTS["sapo"] == PAPER_DEFAULTS["sapo_seq"] == {"tau_pos": 1.0, "tau_neg": 1.05}
    assert AGGREGATIONS == (
        "seq-mean-token-mean",
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
    )
    logp, old, adv, mask, _ = make_batch(14, B=2, T=3)
    with pytest.raises(ValueError, match="unknown objective 'ppo'"):
        policy_loss("ppo", logp, old, adv, mask)
    with pytest.raises(
        TypeError, match="mask"
    ):  # the padded form needs its mask; the packed one is LossInputs
        policy_loss("gspo", logp, old, adv)
    seg = torch.tensor([0, 0, 1])
    with pytest.raises(TypeError, match="num_segments"):
        LossInputs(logp[0], old[0], adv, seg)
    # the paper's knobs are the default: the same loss as passing them explicitly
    for kind in KINDS:
        off = old - 0.05 * torch.sign(adv)[:, None]
        default, _ = policy_loss(kind, logp, off, adv, mask)
        explicit, _ = policy_loss(kind, logp, off, adv, mask, **PAPER_DEFAULTS[kind])
        torch.testing.assert_close(default, explicit)


# ---------------------------------------------------------------- the entropy bonus


def _entropy_inputs(dtype=torch.float64):
    """Hand-made logits of 7 packed tokens in 2 segments (one token outside any), the sampled tokens and the
    old log-probs; the entropy and log-probs are functions of the logits, so autograd reaches them."""
    g = torch.Generator().manual_seed(21)
    logits = torch.randn(7, 5, generator=g, dtype=dtype).requires_grad_()
    targets = torch.tensor([0, 3, 1, 4, 2, 2, 0])
    segment_ids = torch.tensor([0, 0, 0, -1, 1, 1, 1])
    old = torch.log_softmax(logits.detach(), -1).gather(1, targets[:, None]).squeeze(1) + 1e-4
    return logits, targets, segment_ids, old


@pytest.mark.parametrize("kind", KINDS)
def test_entropy_bonus_value_and_gradient_equal_autograds_of_the_formula(kind):
    """loss = policy loss - c (1/n) sum_t H_t over the completion tokens, H_t = -sum_j pi_tj log pi_tj:
    the value and the gradient (through the logits) against the formula written by hand, for every
    objective; the bonus subtracted from the policy loss alone."""
    coef, adv = 0.3, torch.tensor([1.0, -0.5], dtype=torch.float64)
    logits, targets, segment_ids, old = _entropy_inputs()
    log_pi = torch.log_softmax(logits, -1)
    logp = log_pi.gather(1, targets[:, None]).squeeze(1)
    entropy = -(log_pi.exp() * log_pi).sum(-1)
    spec = LossSpec(kind, entropy_coef=coef)
    loss, metrics = compute_loss(spec, LossInputs(logp, old, adv, segment_ids, 2, entropy=entropy))
    (grad,) = torch.autograd.grad(loss, logits)

    x = logits.detach().clone().requires_grad_()
    lp = torch.log_softmax(x, -1)
    plain, _ = compute_loss(
        LossSpec(kind), LossInputs(lp.gather(1, targets[:, None]).squeeze(1), old, adv, segment_ids, 2)
    )
    h = -(lp.exp() * lp).sum(-1)
    by_hand = plain - coef * (h[0] + h[1] + h[2] + h[4] + h[5] + h[6]) / 6  # token 3 is outside every segment
    (want,) = torch.autograd.grad(by_hand, x, retain_graph=True)
    # float64, a few operations on O(1) values: ~1e-16 apart
    torch.testing.assert_close(loss, by_hand, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-14)  # the same bound
    want_mean = entropy.detach()[segment_ids >= 0].mean()
    assert metrics["entropy"].item() == pytest.approx(want_mean.item(), rel=1e-6)  # stored as float32
    # the bonus pushes toward higher entropy: its part of the gradient is nonzero
    (plain_grad,) = torch.autograd.grad(plain, x)
    assert (want - plain_grad).abs().max() > 0.01


def test_entropy_bonus_accumulates_exactly_over_micro_batches():
    """Two micro-batches with the minibatch's token count as entropy_normalizer sum to the whole."""
    logits, targets, segment_ids, old = _entropy_inputs()
    log_pi = torch.log_softmax(logits, -1)
    logp, entropy = log_pi.gather(1, targets[:, None]).squeeze(1), -(log_pi.exp() * log_pi).sum(-1)
    adv = torch.tensor([1.0, -0.5], dtype=torch.float64)
    spec = LossSpec("gspo", entropy_coef=0.2)
    whole, _ = compute_loss(spec, LossInputs(logp, old, adv, segment_ids, 2, entropy=entropy))
    parts = [
        compute_loss(
            spec,
            LossInputs(logp[t], old[t], adv[[i]], torch.zeros(3, dtype=torch.long), 1, entropy=entropy[t],
                       normalizer=2, entropy_normalizer=6),
        )[0]
        for i, t in enumerate((slice(0, 3), slice(4, 7)))
    ]  # fmt: skip
    # float64: the same sums in another order
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-12, atol=1e-14)
    g_whole = torch.autograd.grad(whole, logits, retain_graph=True)[0]
    g_parts = torch.autograd.grad(parts[0] + parts[1], logits)[0]
    torch.testing.assert_close(g_parts, g_whole, rtol=1e-12, atol=1e-14)  # the same bound


def test_entropy_bonus_needs_the_entropy():
    logp = torch.zeros(3)
    with pytest.raises(ValueError, match=r"entropy_coef=0\.1 needs entropy"):
        compute_loss(
            LossSpec("gspo", entropy_coef=0.1),
            LossInputs(logp, logp, torch.ones(1), torch.zeros(3, dtype=torch.long), 1),
        )
