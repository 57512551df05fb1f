"""Numbers, not shapes: the objectives against hand values, a naive per-sequence loop, and each other."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from gspo.core.objectives import AGGREGATIONS, PAPER_CLIP, policy_loss
from gspo.core.objectives import OBJECTIVES as KINDS


def _padded(kind):
    def loss(logp, old_logp, advantages, mask, **kwargs):
        return policy_loss(kind, logp, old_logp, advantages, mask, **kwargs)

    return loss


def _packed(kind):
    def loss(logp, old_logp, advantages, segment_ids, num_segments, **kwargs):
        return policy_loss(
            kind, logp, old_logp, advantages, segment_ids=segment_ids, num_segments=num_segments, **kwargs
        )

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


def naive_loss(kind, logp, old, adv, mask, eps_low, eps_high, aggregation, ref=None, beta=0.0):
    """The paper's formulas, one sequence at a time, with min() and clamp() as written."""
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
        if kind == "gspo":
            ratio = torch.exp(log_s).expand(n)
        elif kind == "gspo_token":
            ratio = torch.exp(log_s.detach() + lp - lp.detach())
        else:
            ratio = torch.exp(lp - olp)
        tok = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a)
        if ref is not None:
            d = ref[i, idx] - lp
            tok = tok + beta * (torch.exp(d) - d - 1)
        terms.append(tok.sum())
        weights.append(1.0 / n if aggregation == "seq-mean-token-mean" else 1.0)
    total = sum(w * t for w, t in zip(terms, weights, strict=True)) if terms else logp.sum() * 0
    return total / (max(total_tokens, 1) if aggregation == "token-mean" else B)


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
        assert loss.item() == pytest.approx(expected.item(), abs=1e-12)
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
    assert loss.item() == pytest.approx(expected, abs=1e-12)
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
    assert loss.item() == pytest.approx((-1.3 + 1.5 - 1.3 + 3.0) / 4, abs=1e-12)
    # d s_i,t / d logp_t = s_i: only the unclipped tokens' own log-prob gets a gradient
    torch.testing.assert_close(
        grad_of(loss, logp), torch.tensor([[0.0, 1.5, 0.0, 3.0]], dtype=torch.float64) / 4
    )
    assert m["clip_frac_token_high"].item() == pytest.approx(0.5)
    assert m["clip_frac_seq"].item() == pytest.approx(0.5)
    assert m["num_seq_nonzero_adv"].item() == 1


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
    per_token_adv = per_token_adv and kind != "gspo"
    logp, old, adv, mask, ref = make_batch(seed, B, T, per_token_adv=per_token_adv, dtype=torch.float64)
    ref = ref if with_kl else None
    kwargs = dict(eps_low=eps[0], eps_high=eps[1], aggregation=aggregation, ref_logp=ref, beta=0.1)
    loss, _ = OBJECTIVES[kind](logp, old, adv, mask, **kwargs)
    expected = naive_loss(kind, logp, old, adv, mask, eps[0], eps[1], aggregation, ref, 0.1)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad_of(loss, logp), grad_of(expected, logp))


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
def test_on_policy_gspo_gradient_equals_grpo(seed):
    logp, _, adv, mask, _ = make_batch(seed, B=6, T=8)
    old = logp.detach()  # on-policy: ratios are 1 in value, not in gradient
    loss_gspo, _ = gspo_loss(logp, old, adv, mask)
    loss_grpo, _ = grpo_loss(logp, old, adv, mask)
    torch.testing.assert_close(loss_gspo, loss_grpo)
    torch.testing.assert_close(grad_of(loss_gspo, logp), grad_of(loss_grpo, logp))
    assert grad_of(loss_gspo, logp).abs().sum() > 0


@pytest.mark.parametrize(
    ("kind", "per_token_adv"), [("gspo", False), ("gspo_token", False), ("gspo_token", True), ("grpo", True)]
)
def test_packed_equals_padded(kind, per_token_adv):
    logp, old, adv, mask, ref = make_batch(3, B=5, T=7, spread=0.2, per_token_adv=per_token_adv, empty_row=2)
    kwargs = dict(eps_low=0.05, eps_high=0.08, ref_logp=ref, beta=0.1)
    for aggregation in AGGREGATIONS:
        loss, m = OBJECTIVES[kind](logp, old, adv, mask, aggregation=aggregation, **kwargs)
        p_logp, p_old, p_adv, seg, p_ref = to_packed(logp, old, adv, mask, ref)
        kwargs["ref_logp"] = p_ref
        p_loss, p_m = PACKED_OBJECTIVES[kind](p_logp, p_old, p_adv, seg, 5, aggregation=aggregation, **kwargs)
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
    kwargs = dict(eps_low=0.02, eps_high=0.03, aggregation=aggregation, ref_logp=ref, beta=0.1)
    full, _ = OBJECTIVES[kind](logp, old, adv, mask, **kwargs)
    normalizer = mask.sum() if aggregation == "token-mean" else 6
    total = 0
    for rows in (slice(0, 2), slice(2, 4), slice(4, 6)):
        kwargs["ref_logp"] = ref[rows]
        part, _ = OBJECTIVES[kind](
            logp[rows], old[rows], adv[rows], mask[rows], normalizer=normalizer, **kwargs
        )
        total = total + part
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(grad_of(total, logp), grad_of(full, logp))


@pytest.mark.parametrize("kind", KINDS)
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
    # long sequences: a bf16 sum of 2048 log-ratios would be off by far more than 1e-5
    g = torch.Generator().manual_seed(6)
    old16 = (-3 * torch.rand(3, 2048, generator=g)).to(torch.bfloat16)
    logp16 = (old16.float() + 0.01 * torch.randn(3, 2048, generator=g)).to(torch.bfloat16).requires_grad_()
    adv, mask = torch.tensor([1.0, -0.5, 0.3]), torch.ones(3, 2048, dtype=torch.bool)
    loss16, m16 = OBJECTIVES[kind](logp16, old16, adv, mask, eps_low=0.2, eps_high=0.27)
    logp32 = logp16.detach().float().requires_grad_()
    loss32, m32 = OBJECTIVES[kind](logp32, old16.float(), adv, mask, eps_low=0.2, eps_high=0.27)
    assert loss16.dtype == torch.float32
    torch.testing.assert_close(loss16, loss32, rtol=0, atol=0)
    assert m16["ratio_seq_mean"] == m32["ratio_seq_mean"]
    grad16 = grad_of(loss16, logp16)
    assert grad16.dtype == torch.bfloat16
    torch.testing.assert_close(grad16, grad_of(loss32, logp32).to(torch.bfloat16), rtol=0, atol=0)
    logp64 = logp16.detach().double()
    expected = naive_loss(kind, logp64, old16.double(), adv.double(), mask, 0.2, 0.27, "seq-mean-token-mean")
    assert loss16.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)


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
    for B, T in [(0, 4), (3, 4), (2, 0)]:
        logp = torch.full((B, T), float("nan"), requires_grad=True)
        mask = torch.zeros(B, T, dtype=torch.bool)
        loss, m = OBJECTIVES[kind](
            logp, logp.detach(), torch.zeros(B), mask, ref_logp=logp.detach(), beta=0.1
        )
        loss.backward()
        assert loss.item() == 0.0
        assert set(m) == METRIC_KEYS | {"kl"}
        assert all(v.item() == 0.0 for v in m.values())
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
    for check_finite, expected in [(False, 0), (True, 1)]:
        with CountHostSyncs() as counter:
            loss, _ = OBJECTIVES[kind](
                logp, old, adv, mask, ref_logp=ref, beta=0.1, check_finite=check_finite
            )
            grad_of(loss, logp)
        assert counter.syncs == expected
        with CountHostSyncs() as counter:
            fn = PACKED_OBJECTIVES[kind]
            loss, _ = fn(p_logp, p_old, p_adv, seg, 4, ref_logp=p_ref, beta=0.1, check_finite=check_finite)
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


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_two_rank_sequence_parallel_split_sums_to_unsplit(kind, aggregation):
    logp, old, adv, mask, ref = make_batch(13, B=4, T=6, spread=0.05, dtype=torch.float64, empty_row=3)
    p_logp, p_old, p_adv, seg, p_ref = to_packed(logp, old, adv, mask, ref, prompt_len=1)
    kwargs = dict(eps_low=0.01, eps_high=0.02, aggregation=aggregation, beta=0.2)
    fn = PACKED_OBJECTIVES[kind]
    loss, m = fn(p_logp, p_old, p_adv, seg, 4, ref_logp=p_ref, **kwargs)
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
    if kind == "gspo":
        torch.testing.assert_close(m0["clip_frac_seq"], m["clip_frac_seq"])


def test_objective_names_defaults_and_entry_point_errors():
    assert KINDS == ("gspo", "gspo_token", "grpo")
    assert PAPER_CLIP == {"gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "grpo": (0.2, 0.27)}
    assert AGGREGATIONS == ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum")
    logp, old, adv, mask, _ = make_batch(14, B=2, T=3)
    with pytest.raises(ValueError, match="unknown objective 'ppo'"):
        policy_loss("ppo", logp, old, adv, mask)
    with pytest.raises(ValueError, match=r"either mask .* or segment_ids"):
        policy_loss("gspo", logp, old, adv)
    seg = torch.tensor([0, 0, 1])
    with pytest.raises(ValueError, match="segment_ids needs num_segments"):
        policy_loss("gspo", logp[0], old[0], adv, segment_ids=seg)
    # the paper's clip range is the default: the same loss as passing it explicitly
    for kind in KINDS:
        off = old - 0.05 * torch.sign(adv)[:, None]
        default, _ = policy_loss(kind, logp, off, adv, mask)
        explicit, _ = policy_loss(
            kind, logp, off, adv, mask, eps_low=PAPER_CLIP[kind][0], eps_high=PAPER_CLIP[kind][1]
        )
        torch.testing.assert_close(default, explicit)
