"""gspo.core.logprobs against the naive full-logits computation: values and gradients, then transformers models."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gspo.core.logprobs import causal_lm_logprobs, token_logprobs

N, H, V = 48, 24, 300
# FP32: both sides fp32, the same sums in other orders (chunked GEMMs of other row counts, 1/T folded into h,
# the [j = t] gradient term added apart; in the model tests the decoder on another batch shape). A sum of n
# terms is off by ~sqrt(n)*u times their magnitudes (u = 2^-24, independent rounding): a logit by
# ~sqrt(H)*u*sum|h_i w_i|/T <= 1e-5 here, and log pi by <= 2 |log pi| max|dz| (as 1 - pi_t <= -log pi_t):
# rtol 1e-4. A gradient entry sums <= 300 terms of size <= ~5: ~sqrt(300)*u*5 = 5e-6 where they cancel to ~0:
# atol 2e-5. A real bug (a wrong target, chunk or temperature) moves values by >= 1e-2.
FP32 = {"atol": 2e-5, "rtol": 1e-4}


def naive_logprobs(hidden, weight, targets, temperature=1.0, bias=None):
    """log pi(target) from the full (N, V) logits."""
    logits = hidden @ weight.T
    if bias is not None:
        logits = logits + bias
    log_pi = torch.log_softmax(logits / temperature, dim=-1)
    return log_pi.gather(1, targets[:, None]).squeeze(1)


def make_head_inputs(seed=0, n=N, with_bias=False, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=gen) * 0.3).to(dtype).requires_grad_()
    bias = torch.randn(V, generator=gen).to(dtype).requires_grad_() if with_bias else None
    targets = torch.randint(0, V, (n,), generator=gen)
    upstream = torch.randn(n, generator=gen)
    return hidden, weight, bias, targets, upstream


def grads_of(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("chunk_size", [16, 7, 1, 1000])  # divides N, does not, one token, > N
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
def test_token_logprobs_values_and_grads_equal_naive(chunk_size, temperature, with_bias):
    hidden, weight, bias, targets, upstream = make_head_inputs(with_bias=with_bias)
    logp = token_logprobs(
        hidden, weight, targets, chunk_size=chunk_size, temperature=temperature, lm_head_bias=bias
    )
    ref = naive_logprobs(hidden, weight, targets, temperature, bias)
    assert logp.dtype == torch.float32 and logp.shape == (N,)
    torch.testing.assert_close(logp, ref, **FP32)  # FP32: see its definition
    inputs = (hidden, weight, bias)
    for got, want in zip(
        grads_of((logp * upstream).sum(), inputs), grads_of((ref * upstream).sum(), inputs), strict=True
    ):
        torch.testing.assert_close(got, want, **FP32)  # FP32: see its definition


@pytest.mark.parametrize("chunk_size", [7, 100])  # several chunks, one chunk
def test_second_backward_with_retain_graph_is_exact(chunk_size):
    """The backward consumes the forward's last block in place; a second backward must recompute it."""
    hidden, weight, bias, targets, upstream = make_head_inputs(seed=9, with_bias=True)
    out = token_logprobs(hidden, weight, targets, chunk_size=chunk_size, lm_head_bias=bias)
    loss = (out * upstream).sum()
    first = torch.autograd.grad(loss, (hidden, weight, bias), retain_graph=True)
    second = torch.autograd.grad(loss, (hidden, weight, bias))
    for a, b in zip(first, second, strict=True):
        # the first exponentiates the forward's log pi of the last chunk, the second recomputes its softmax:
        # pi differs by ~u*|log pi| relative, the gradients within FP32 (see its definition)
        torch.testing.assert_close(a, b, **FP32)
    ref_loss = (naive_logprobs(hidden, weight, targets, bias=bias) * upstream).sum()
    for a, b in zip(second, grads_of(ref_loss, (hidden, weight, bias)), strict=True):
        torch.testing.assert_close(a, b, **FP32)  # FP32: see its definition


def test_tied_embedding_grads_accumulate_like_naive():
    """Head weight = input embedding: grads flow through the lookup and through the head."""
    gen = torch.Generator().manual_seed(3)
    embedding = (torch.randn(V, H, generator=gen) * 0.3).requires_grad_()
    mixer = torch.randn(H, H, generator=gen) / H**0.5
    ids = torch.randint(0, V, (N + 1,), generator=gen)
    upstream = torch.randn(N, generator=gen)

    def loss(logprob_fn):
        hidden = torch.tanh(embedding[ids[:-1]] @ mixer)  # a toy decoder on the embedded inputs
        return (logprob_fn(hidden, embedding, ids[1:]) * upstream).sum()

    (got,) = torch.autograd.grad(loss(lambda h, w, t: token_logprobs(h, w, t, chunk_size=10)), [embedding])
    (want,) = torch.autograd.grad(loss(lambda h, w, t: naive_logprobs(h, w, t)), [embedding])
    # FP32 (see its definition): the head's gradient, and the same toy decoder's backward on top
    torch.testing.assert_close(got, want, **FP32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_computed_in_fp32(dtype):
    hidden, weight, bias, targets, upstream = make_head_inputs(seed=4, with_bias=True, dtype=dtype)
    logp = token_logprobs(hidden, weight, targets, chunk_size=7, temperature=0.9, lm_head_bias=bias)
    assert logp.dtype == torch.float32
    # naive in fp32 on the upcast (bf16-valued) inputs: fp32 accumulation gives fp32-level agreement
    up = [t.detach().float().requires_grad_() for t in (hidden, weight, bias)]
    ref_logp = naive_logprobs(up[0], up[1], targets, 0.9, up[2])
    torch.testing.assert_close(logp, ref_logp, atol=1e-4, rtol=1e-4)
    got = grads_of((logp * upstream).sum(), (hidden, weight, bias))
    want = grads_of((ref_logp * upstream).sum(), up)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype
        # the only rounding left is the final cast of the fp32 gradient to the input dtype: <= 2^-8 relative
        # in bf16, 2^-11 in fp16
        torch.testing.assert_close(g.float(), w, atol=1e-2, rtol=1e-2)


def test_no_grad_path_builds_no_graph_and_matches():
    hidden, weight, bias, targets, _ = make_head_inputs(seed=6, with_bias=True)
    with torch.no_grad():
        logp = token_logprobs(hidden, weight, targets, chunk_size=9, lm_head_bias=bias)
    assert not logp.requires_grad
    # FP32: see its definition
    torch.testing.assert_close(logp, naive_logprobs(hidden, weight, targets, bias=bias), **FP32)


def naive_entropy(hidden, weight, temperature=1.0, bias=None):
    """H = -sum_j pi_j log pi_j of each row, from the full (N, V) logits."""
    logits = hidden @ weight.T + (0 if bias is None else bias)
    log_pi = torch.log_softmax(logits / temperature, dim=-1)
    return -(log_pi.exp() * log_pi).sum(-1)


@pytest.mark.parametrize("chunk_size", [16, 7, 1, 1000])  # divides N, does not, one token, > N
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
def test_token_entropy_and_its_gradient_equal_autograds_of_the_full_logits(
    chunk_size, temperature, with_bias
):
    """The entropy bonus's input: each row's entropy and the gradient of g . logp + e . H (both outputs
    at once, as the loss uses them) against autograd of the formula on the full logits."""
    hidden, weight, bias, targets, upstream = make_head_inputs(seed=12, with_bias=with_bias)
    e = torch.randn(N, generator=torch.Generator().manual_seed(13))
    logp, entropy = token_logprobs(
        hidden,
        weight,
        targets,
        chunk_size=chunk_size,
        temperature=temperature,
        lm_head_bias=bias,
        entropy=True,
    )
    ref_logp = naive_logprobs(hidden, weight, targets, temperature, bias)
    ref_entropy = naive_entropy(hidden, weight, temperature, bias)
    torch.testing.assert_close(logp, ref_logp, **FP32)  # FP32: see its definition
    # FP32 (see its definition): |dH| <= 2 H max|dz| as |log pi| is for log pi, the same relative bound
    torch.testing.assert_close(entropy, ref_entropy, **FP32)
    assert entropy.min() > 0.5  # a real spread of probabilities, not a degenerate test
    inputs = (hidden, weight, bias)
    got = grads_of((logp * upstream + entropy * e).sum(), inputs)
    want = grads_of((ref_logp * upstream + ref_entropy * e).sum(), inputs)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **FP32)  # FP32: see its definition
    # the entropy's own part of the gradient is there (a bonus that changed nothing would pass the above
    # only if e's terms were negligible): without it the gradient is off by far more than the tolerance
    (plain,) = grads_of(
        (naive_logprobs(hidden, weight, targets, temperature, bias) * upstream).sum(), (hidden,)
    )
    assert (got[0] - plain).abs().max() > 100 * FP32["atol"]


def test_token_entropy_without_grad_matches():
    hidden, weight, bias, targets, _ = make_head_inputs(seed=14, with_bias=True)
    with torch.no_grad():
        logp, entropy = token_logprobs(hidden, weight, targets, chunk_size=9, lm_head_bias=bias, entropy=True)
    assert not entropy.requires_grad
    # FP32: see its definition
    torch.testing.assert_close(entropy, naive_entropy(hidden, weight, bias=bias), **FP32)
    torch.testing.assert_close(
        logp, naive_logprobs(hidden, weight, targets, bias=bias), **FP32
    )  # FP32: as above


def test_extreme_logits_stay_finite():
    hidden, weight, _, targets, upstream = make_head_inputs(seed=7)
    hidden = (hidden.detach() * 300).requires_grad_()
    logp = token_logprobs(hidden, weight, targets, chunk_size=8)
    ref = naive_logprobs(hidden.double(), weight.double(), targets)
    torch.testing.assert_close(logp.double(), ref, atol=1e-2, rtol=1e-4)
    (grad,) = torch.autograd.grad((logp * upstream).sum(), [hidden])
    assert torch.isfinite(grad).all()


def test_empty_input():
    hidden, weight, _, targets, _ = make_head_inputs(n=0)
    logp = token_logprobs(hidden, weight, targets)
    assert logp.shape == (0,)
    (grad,) = torch.autograd.grad(logp.sum(), [weight], allow_unused=True)
    assert grad is None or not grad.any()


@pytest.mark.parametrize("shape", [(3, 49152), (5, 7), (2, 1)])
@pytest.mark.parametrize("fn", [torch.softmax, torch.log_softmax])
def test_in_place_softmax_is_exact(fn, shape):
    """token_logprobs relies on (log_)softmax(x, out=x) equalling the out-of-place result."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(8)) * 5
    want = fn(x, dim=-1)
    fn(x, dim=-1, out=x)
    # exact by design: the same kernel on the same rows, only the output buffer aliases the input
    torch.testing.assert_close(x, want, rtol=0, atol=0)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 40),
    vocab=st.integers(2, 60),
    chunk_size=st.integers(1, 50),
    temperature=st.floats(0.3, 2.0),
    seed=st.integers(0, 2**16),
)
def test_token_logprobs_property(n, vocab, chunk_size, temperature, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, 8, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, 8, generator=gen, requires_grad=True)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    logp = token_logprobs(hidden, weight, targets, chunk_size=chunk_size, temperature=temperature)
    ref = naive_logprobs(hidden, weight, targets, temperature)
    # FP32 (see its definition): |h_i w_i| sums to <= ~50 at T = 0.3, a logit's error to ~sqrt(8)*u*50 = 8e-6
    torch.testing.assert_close(logp, ref, **FP32)
    for g, w in zip(
        grads_of(logp.sum(), (hidden, weight)), grads_of(ref.sum(), (hidden, weight)), strict=True
    ):
        torch.testing.assert_close(g, w, **FP32)  # FP32: see its definition


# ---------------------------------------------------------------- transformers models (tiny, random, offline)

SEQUENCES = [[5, 17, 99, 3, 42, 7, 8], [11, 2, 63], [101, 4, 4, 90, 12]]
PAD = 0
LLAMA_VOCAB = 128


def tiny_llama(attn_implementation="sdpa", tie=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=LLAMA_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        attn_implementation=attn_implementation,
    )
    return LlamaForCausalLM(config).eval()


def padded_batch(left: bool):
    width = max(map(len, SEQUENCES))
    ids = torch.full((len(SEQUENCES), width), PAD)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(SEQUENCES):
        cols = slice(width - len(seq), width) if left else slice(0, len(seq))
        ids[row, cols] = torch.tensor(seq)
        mask[row, cols] = 1
    return ids, mask


def packed_row():
    ids = torch.tensor([[token for seq in SEQUENCES for token in seq]])
    position_ids = torch.tensor([[p for seq in SEQUENCES for p in range(len(seq))]])
    return ids, position_ids


def reference_per_sequence(model, temperature=1.0):
    """Log-probs of each sequence run alone through model(...).logits: the ground truth."""
    out = []
    for seq in SEQUENCES:
        ids = torch.tensor([seq])
        log_pi = torch.log_softmax(model(ids).logits[0, :-1].float() / temperature, dim=-1)
        out.append(log_pi.gather(1, ids[0, 1:, None]).squeeze(1))
    return out


def unpad(values, mask):
    """Per-sequence scored values (positions 1.. of each real span) from a padded (B, T) output."""
    return [row[m.bool()][1:] for row, m in zip(values, mask, strict=True)]


def unpack(values):
    out, start = [], 0
    for seq in SEQUENCES:
        out.append(values[0, start + 1 : start + len(seq)])
        start += len(seq)
    return out


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_llama_padded_and_packed_equal_logits_path(attn_implementation):
    model = tiny_llama(attn_implementation)
    temperature = 0.8
    with torch.no_grad():
        want = reference_per_sequence(model, temperature)
        for left in (False, True):
            ids, mask = padded_batch(left)
            logp = causal_lm_logprobs(model, ids, attention_mask=mask, temperature=temperature, chunk_size=4)
            assert logp.shape == ids.shape and logp.dtype == torch.float32
            for got, ref in zip(unpad(logp, mask), want, strict=True):
                # FP32 (see its definition): the decoder on a padded batch against each sequence alone; log pi
                # (~ -4.8) moves by <= |h| |w_t - w_mean| / T = 5.7 * 0.14 / 0.8 = 1 times the hidden state's
                # relative error
                torch.testing.assert_close(got, ref, **FP32)
            # exactly 0 on padding and on each sequence's first token
            first_real = mask.float().argmax(1)
            assert (logp[~mask.bool()] == 0).all() and (logp.gather(1, first_real[:, None]) == 0).all()
            # the same batch through model(...).logits, the way a trainer would do it naively
            position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(ids, attention_mask=mask, position_ids=position_ids).logits.float() / temperature
            naive = torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None]).squeeze(2)
            scored = mask[:, 1:].bool() & mask[:, :-1].bool()
            # FP32 (see its definition): the same decoder pass; the head in chunks of 4 rows, 1/T on h
            torch.testing.assert_close(logp[:, 1:][scored], naive[scored], **FP32)

        ids, position_ids = packed_row()
        logp = causal_lm_logprobs(
            model, ids, position_ids=position_ids, temperature=temperature, chunk_size=4
        )
        for got, ref in zip(unpack(logp), want, strict=True):
            torch.testing.assert_close(got, ref, **FP32)  # FP32: see its definition (a packed row)
        starts = torch.tensor([0, *torch.tensor(list(map(len, SEQUENCES))).cumsum(0)[:-1].tolist()])
        assert (logp[0, starts] == 0).all()

        # two packed rows, the second with tail padding whose positions restart (as gspo.core.layout does)
        first, second = SEQUENCES[0] + SEQUENCES[1], SEQUENCES[2] + [PAD] * 5
        ids = torch.tensor([first, second])
        position_ids = torch.tensor(
            [
                [*range(len(SEQUENCES[0])), *range(len(SEQUENCES[1]))],
                [*range(len(SEQUENCES[2])), *range(5)],
            ]
        )
        logp = causal_lm_logprobs(model, ids, position_ids=position_ids, temperature=temperature)
        n0, n2 = len(SEQUENCES[0]), len(SEQUENCES[2])
        for got, ref in zip((logp[0, 1:n0], logp[0, n0 + 1 :], logp[1, 1:n2]), want, strict=True):
            torch.testing.assert_close(got, ref, **FP32)  # FP32: see its definition (two packed rows)


@pytest.mark.parametrize("tie", [False, True])
def test_llama_gradients_equal_logits_path(tie):
    model = tiny_llama(tie=tie)
    ids, mask = padded_batch(left=True)
    upstream = torch.randn(ids.shape, generator=torch.Generator().manual_seed(0))
    params = [p for p in model.parameters() if p.requires_grad]

    logp = causal_lm_logprobs(model, ids, attention_mask=mask, temperature=0.7, chunk_size=3)
    got = torch.autograd.grad((logp * upstream).sum(), params)

    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(ids, attention_mask=mask, position_ids=position_ids).logits / 0.7
    naive = torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None]).squeeze(2)
    scored = (mask[:, 1:] * mask[:, :-1]).float()
    want = torch.autograd.grad((naive * scored * upstream[:, 1:]).sum(), params)
    for (name, _), g, w in zip(model.named_parameters(), got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


def test_llama_entropy_and_its_gradients_equal_logits_path():
    """causal_lm_logprobs(entropy=True) on a tied-embedding model: the entropy of each scored position's
    distribution and the gradients of logp + H against the model's own logits."""
    model = tiny_llama(tie=True)
    ids, mask = padded_batch(left=True)
    params = [p for p in model.parameters() if p.requires_grad]
    logp, entropy = causal_lm_logprobs(
        model, ids, attention_mask=mask, temperature=0.7, chunk_size=3, entropy=True
    )
    scored = (mask[:, 1:] * mask[:, :-1]).bool()
    got = torch.autograd.grad((logp + entropy).sum(), params)

    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(ids, attention_mask=mask, position_ids=position_ids).logits[:, :-1] / 0.7
    log_pi = torch.log_softmax(logits, -1)
    naive_logp = log_pi.gather(2, ids[:, 1:, None]).squeeze(2)
    naive_entropy_ = -(log_pi.exp() * log_pi).sum(-1)
    assert torch.equal(entropy[:, 1:] != 0, scored) and torch.all(entropy[:, 0] == 0)
    torch.testing.assert_close(entropy[:, 1:][scored], naive_entropy_[scored], **FP32)  # FP32: its definition
    want = torch.autograd.grad(((naive_logp + naive_entropy_) * scored).sum(), params)
    for (name, _), g, w in zip(model.named_parameters(), got, want, strict=True):
        # as test_llama_gradients_equal_logits_path
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


def test_packed_gradients_equal_padded():
    model = tiny_llama()
    params = list(model.parameters())
    ids, mask = padded_batch(left=False)
    padded = causal_lm_logprobs(model, ids, attention_mask=mask)
    got = torch.autograd.grad(sum(v.sum() for v in unpad(padded, mask)), params)
    ids, position_ids = packed_row()
    packed = causal_lm_logprobs(model, ids, position_ids=position_ids)
    want = torch.autograd.grad(sum(v.sum() for v in unpack(packed)), params)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


def test_logprob_mask_scores_only_the_positions_asked_for():
    model = tiny_llama()
    ids, mask = padded_batch(left=False)
    completion = torch.zeros_like(mask, dtype=torch.bool)
    completion[:, 2:] = True  # e.g. the first two tokens are the prompt
    with torch.no_grad():
        # chunk_size=1: each scored row's head GEMM is the same (1, 32) x (32, 128) one in both calls (in one
        # GEMM of 9 or 12 rows a BLAS may round a row differently: MKL's AVX2 kernels do)
        logp = causal_lm_logprobs(model, ids, attention_mask=mask, logprob_mask=completion, chunk_size=1)
        full_logp = causal_lm_logprobs(model, ids, attention_mask=mask, chunk_size=1)
        logits = model(ids, attention_mask=mask).logits
    scored = completion & mask.bool()
    assert (logp[~scored] == 0).all()
    # exact by design: the same decoder pass on the same batch, then the same kernels on the same rows
    torch.testing.assert_close(logp[scored], full_logp[scored], rtol=0, atol=0)
    log_pi = torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None]).squeeze(2)
    # FP32 (see its definition): the same decoder pass; the head row by row against one GEMM
    torch.testing.assert_close(logp[:, 1:][scored[:, 1:]], log_pi[scored[:, 1:]], **FP32)


def test_rejects_what_it_cannot_compute_exactly():
    model = tiny_llama()
    ids, position_ids = packed_row()
    with pytest.raises(ValueError, match="attention_mask"):
        causal_lm_logprobs(model, ids, attention_mask=torch.ones_like(ids), position_ids=position_ids)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(NotImplementedError, match="final_logit_softcapping"):
        causal_lm_logprobs(model, ids)


def test_qwen3_moe_equals_logits_path():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=LLAMA_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    model = Qwen3MoeForCausalLM(config).eval()
    ids, mask = padded_batch(left=True)
    with torch.no_grad():
        logp = causal_lm_logprobs(model, ids, attention_mask=mask, chunk_size=5)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(ids, attention_mask=mask, position_ids=position_ids).logits
    naive = torch.log_softmax(logits[:, :-1].float(), -1).gather(2, ids[:, 1:, None]).squeeze(2)
    scored = mask[:, 1:].bool() & mask[:, :-1].bool()
    # FP32 (see its definition): the same decoder pass (so the same expert choices); the head in chunks of 5
    torch.testing.assert_close(logp[:, 1:][scored], naive[scored], **FP32)


def test_peft_lora_model():
    peft = pytest.importorskip("peft")
    model = tiny_llama()
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    ids, mask = padded_batch(left=False)
    logp = causal_lm_logprobs(lora, ids, attention_mask=mask)
    logits = lora(input_ids=ids, attention_mask=mask).logits
    naive = torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None]).squeeze(2)
    scored = mask[:, 1:].bool() & mask[:, :-1].bool()
    torch.testing.assert_close(logp[:, 1:][scored], naive[scored], **FP32)  # FP32: the same decoder pass
    lora_params = [p for n, p in lora.named_parameters() if p.requires_grad]
    assert lora_params and all("lora_" in n for n, p in lora.named_parameters() if p.requires_grad)
    got = torch.autograd.grad(logp.sum(), lora_params)
    want = torch.autograd.grad((naive * scored).sum(), lora_params)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


def test_autocast_stops_at_the_head():
    """Under bf16 autocast (train.mixed_precision) the head's log-probs stay exact fp32."""
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(20, 16, generator=g), torch.randn(50, 16, generator=g)
    targets = torch.randint(0, 50, (20,), generator=g)
    exact = token_logprobs(hidden, weight, targets, chunk_size=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = token_logprobs(hidden, weight, targets, chunk_size=8)
    assert torch.equal(exact, mixed)
