"""gspo.core.triton_logprobs against the naive full-logits computation and the torch path: values, gradients.

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets
before anything imports triton), so CI checks the same kernel code a GPU compiles. Skipped when triton is
not installed.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

pytest.importorskip("triton")

from gspo.core.logprobs import causal_lm_logprobs, resolve_kernel, token_logprobs
from gspo.models.loading import tiny_model

N, H, V = 37, 16, 97  # N and V not multiples of any block or chunk size
# FP32: the kernels' fp32 against float64 (one side's rounding) or the torch path (the same GEMMs; an online
# log-sum-exp and exp(z - lse) in place of log_softmax and softmax, the [j = t] term in the kernel). A sum of n
# terms is off by ~sqrt(n)*u times their magnitudes (u = 2^-24, independent rounding; a GPU's exp and log are
# within a few ulps): a logit by ~sqrt(16)*u*sum|h_i w_i|/T ~ 4e-6 here (0.5-std weights), log pi by
# <= 2 |log pi| max|dz| (as 1 - pi_t <= -log pi_t): rtol 1e-4. A gradient entry sums <= 97 terms of size
# <= ~9: ~sqrt(97)*u*9 = 5e-6 where they cancel to ~0: atol 2e-5. A real bug (a wrong target, tile mask or
# temperature) moves values by >= 1e-2.
FP32 = {"atol": 2e-5, "rtol": 1e-4}
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def naive_logprobs(hidden, weight, targets, temperature=1.0, bias=None):
    """log pi(target) from the full (N, V) logits, in float64."""
    logits = hidden.double() @ weight.double().T
    if bias is not None:
        logits = logits + bias.double()
    return torch.log_softmax(logits / temperature, dim=-1).gather(1, targets[:, None]).squeeze(1)


def head_inputs(seed=0, n=N, with_bias=False, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=gen).to(DEVICE, dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=gen) * 0.5).to(DEVICE, dtype).requires_grad_()
    bias = torch.randn(V, generator=gen).to(DEVICE, dtype).requires_grad_() if with_bias else None
    targets = torch.randint(0, V, (n,), generator=gen).to(DEVICE)
    upstream = torch.randn(n, generator=gen).to(DEVICE)
    return hidden, weight, bias, targets, upstream


def grads(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("chunk_size", [8, 1000])  # several chunks (the last one short), one chunk
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
def test_values_and_grads_equal_naive_and_torch_path(chunk_size, temperature, with_bias):
    hidden, weight, bias, targets, upstream = head_inputs(with_bias=with_bias)
    kwargs = {"chunk_size": chunk_size, "temperature": temperature, "lm_head_bias": bias}
    logp = token_logprobs(hidden, weight, targets, kernel="triton", **kwargs)
    torch_logp = token_logprobs(hidden, weight, targets, kernel="torch", **kwargs)
    ref = naive_logprobs(hidden, weight, targets, temperature, bias)
    assert logp.dtype == torch.float32 and logp.shape == (N,)
    torch.testing.assert_close(logp.double(), ref, **FP32)  # FP32: see its definition
    torch.testing.assert_close(logp, torch_logp, **FP32)  # FP32: see its definition
    inputs = (hidden, weight, bias)
    got = grads((logp * upstream).sum(), inputs)
    for g, t, r in zip(
        got,
        grads((torch_logp * upstream).sum(), inputs),
        grads((ref * upstream.double()).sum(), inputs),
        strict=True,
    ):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, r, **FP32)  # FP32: see its definition
        torch.testing.assert_close(g, t, **FP32)  # FP32: see its definition


def test_only_some_inputs_need_grad():
    """A frozen head (LoRA) or frozen hidden states: only the asked-for gradients, still exact."""
    hidden, weight, bias, targets, upstream = head_inputs(seed=1, with_bias=True)
    frozen = weight.detach()
    logp = token_logprobs(hidden, frozen, targets, chunk_size=10, lm_head_bias=bias, kernel="triton")
    ref = naive_logprobs(hidden, frozen, targets, bias=bias)
    for g, r in zip(
        grads((logp * upstream).sum(), (hidden, bias)),
        grads((ref * upstream.double()).sum(), (hidden, bias)),
        strict=True,
    ):
        torch.testing.assert_close(g, r, **FP32)  # FP32: see its definition
    logp = token_logprobs(hidden.detach(), weight, targets, chunk_size=10, kernel="triton")
    (g,) = grads((logp * upstream).sum(), (weight,))
    (r,) = grads((naive_logprobs(hidden.detach(), weight, targets) * upstream.double()).sum(), (weight,))
    torch.testing.assert_close(g, r, **FP32)  # FP32: see its definition


def test_second_backward_recomputes_the_consumed_block():
    hidden, weight, bias, targets, upstream = head_inputs(seed=2, with_bias=True)
    loss = (
        token_logprobs(hidden, weight, targets, chunk_size=9, lm_head_bias=bias, kernel="triton") * upstream
    ).sum()
    first = torch.autograd.grad(loss, (hidden, weight, bias), retain_graph=True)
    second = torch.autograd.grad(loss, (hidden, weight, bias))
    for a, b in zip(first, second, strict=True):
        # exact by design: the last chunk's u recomputed by the same GEMM on the same shapes, then the same
        # kernels in the same order (no atomics)
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_no_grad_path_and_bf16_inputs():
    hidden, weight, bias, targets, upstream = head_inputs(seed=3, with_bias=True, dtype=torch.bfloat16)
    with torch.no_grad():
        no_grad = token_logprobs(hidden, weight, targets, chunk_size=8, lm_head_bias=bias, kernel="triton")
    assert not no_grad.requires_grad and no_grad.dtype == torch.float32
    logp = token_logprobs(hidden, weight, targets, chunk_size=8, lm_head_bias=bias, kernel="triton")
    # exact by design: both run the same forward chunks on the same inputs
    torch.testing.assert_close(logp, no_grad, atol=0, rtol=0)
    torch_logp = token_logprobs(hidden, weight, targets, chunk_size=8, lm_head_bias=bias, kernel="torch")
    # the bf16 values upcast, then fp32 arithmetic as the torch path's: FP32 (see its definition)
    torch.testing.assert_close(logp, torch_logp, **FP32)
    for g, t in zip(
        grads((logp * upstream).sum(), (hidden, weight, bias)),
        grads((torch_logp * upstream).sum(), (hidden, weight, bias)),
        strict=True,
    ):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), t.float(), atol=1e-2, rtol=1e-2)  # one bf16 rounding each


def test_extreme_logits_and_empty_input():
    hidden, weight, _, targets, upstream = head_inputs(seed=4)
    big = (hidden.detach() * 300).requires_grad_()
    logp = token_logprobs(big, weight, targets, chunk_size=8, kernel="triton")
    torch.testing.assert_close(logp.double(), naive_logprobs(big, weight, targets), atol=1e-2, rtol=1e-4)
    (g,) = grads((logp * upstream).sum(), (big,))
    assert torch.isfinite(g).all()
    hidden, weight, _, targets, _ = head_inputs(n=0)
    logp = token_logprobs(hidden, weight, targets, kernel="triton")
    assert logp.shape == (0,)
    (g,) = torch.autograd.grad(logp.sum(), [weight], allow_unused=True)
    assert g is None or not g.any()


def test_causal_lm_logprobs_kernels_agree_on_a_model():
    """A tiny Llama (tied head) on packed rows: the same log-probs and parameter gradients either way."""
    model = tiny_model("llama", vocab_size=V, seed=0).to(DEVICE)
    gen = torch.Generator().manual_seed(5)
    input_ids = torch.randint(3, V, (2, 12), generator=gen).to(DEVICE)
    position_ids = torch.cat([torch.arange(5), torch.arange(7)]).repeat(2, 1).to(DEVICE)
    results = []
    for kernel in ("torch", "triton"):
        model.zero_grad(set_to_none=True)
        logp = causal_lm_logprobs(model, input_ids, position_ids=position_ids, chunk_size=7, kernel=kernel)
        logp.sum().backward()
        results.append((logp.detach(), [p.grad.clone() for p in model.parameters()]))
    (a, grads_a), (b, grads_b) = results
    # FP32 (see its definition): the same decoder pass, then the head's passes; the gradients carry the head's
    # differences back through the same decoder backward (0.02-std head: |log pi| ~ 4.6, no cancellation)
    torch.testing.assert_close(a, b, **FP32)
    for ga, gb in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(ga, gb, **FP32)  # FP32: see its definition


def test_kernel_choice(monkeypatch):
    assert resolve_kernel("auto", torch.device("cpu")) == "torch"  # the CPU default stays torch
    assert resolve_kernel("auto", torch.device("cuda")) == "triton"  # triton is installed here
    assert resolve_kernel("torch", torch.device("cuda")) == "torch"
    with pytest.raises(ValueError, match="unknown log-prob kernel"):
        resolve_kernel("cuda", torch.device("cpu"))
    if DEVICE.type == "cpu":  # compiled Triton needs a GPU: the error names the fix
        monkeypatch.delenv("TRITON_INTERPRET")
        hidden, weight, _, targets, _ = head_inputs()
        with pytest.raises(RuntimeError, match="logprob_kernel=torch"):
            token_logprobs(hidden, weight, targets, kernel="triton")


def test_update_spec_selects_the_kernel_for_a_shared_prefix_micro_batch():
    """The learner's `score` passes UpdateSpec.logprob_kernel down: both kernels, one micro-batch."""
    from gspo.core.layout import TokenSequence, make_micro_batches
    from gspo.learning.policy import UpdateSpec, score

    model = tiny_model("llama", vocab_size=V, seed=1).to(DEVICE)
    prompt = [5, 6, 7]
    sequences = [
        TokenSequence(prompt, [8, 9, 10, 11], [True] * 4),
        TokenSequence(prompt, [12, 13], [True] * 2),
    ]
    (mb,) = make_micro_batches(
        sequences, layout="shared_prefix", pack_length=64, micro_batch_tokens=256, pad_id=0
    )
    mb = mb.to(DEVICE)
    with torch.no_grad():
        values = [score(model, mb, UpdateSpec(logprob_kernel=k)) for k in ("torch", "triton")]
    assert values[0].abs().sum() > 0
    torch.testing.assert_close(values[0], values[1], **FP32)  # FP32: the same decoder pass, then the head
