"""``token_logprobs`` with Triton kernels for the passes over each chunk's logits (``train.logprob_kernel``).

The same function, chunking and fp32 arithmetic as the torch path (gspo.core.logprobs): a chunk's logits
u = h W^T are one fp32 GEMM (torch.mm: cuBLAS on a GPU), and two Triton kernels replace the torch passes
over the (chunk, V) block:

- forward: one read of the block gives, per row, log pi(target) and the log-sum-exp of the tempered
  logits z = (u + b) / T, online over vocabulary tiles; the block is never written back (torch: an in-place
  log_softmax, itself two reads and a write, then a gather).
- backward: one read and one write turn the recomputed block into dL/du = s ([j = t] - exp(z - lse)), with
  s = g / T and the forward's lse (no max or sum pass), the [j = t] term included (the torch path gathers
  W[t] and scatters into dW for it); dL/dh = dL/du W and dL/dW = dL/du^T h stay GEMMs.

No atomics: the results are deterministic, and equal to the torch path's up to float rounding. On a CPU
the kernels run only under Triton's interpreter (``TRITON_INTERPRET=1``), which is how CI checks them.
What this buys on a GPU is for benchmarks/gpu.py to measure (docs/gpu.md).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.function import once_differentiable

# Vocabulary tile of the kernels; the forward keeps (m, s) per row across tiles, the backward has one
# program per (row, tile).
MAX_BLOCK_V = 4096


def check_device(device: torch.device) -> None:
    """Triton compiles for GPUs; on a CPU only its interpreter runs the kernels."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"train.logprob_kernel=triton needs CUDA tensors, got {device.type} ones: set "
            "train.logprob_kernel=torch (or auto), or TRITON_INTERPRET=1 to run the kernels interpreted (tests)"
        )


@triton.jit
def _forward_kernel(
    logits_ptr,
    bias_ptr,
    targets_ptr,
    logp_ptr,
    lse_ptr,
    vocab,
    stride,
    inv_t,
    HAS_BIAS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One program per row: lse = log sum_j exp(z_j) online over tiles, log pi(t) = z_t - lse."""
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    target = tl.load(targets_ptr + row)
    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.zeros((), tl.float32)
    target_z = tl.zeros((), tl.float32)
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        valid = cols < vocab
        u = tl.load(row_ptr + cols, mask=valid, other=0.0)
        if HAS_BIAS:
            u += tl.load(bias_ptr + cols, mask=valid, other=0.0)
        z = tl.where(valid, u * inv_t, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(z, 0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(z - new_max), 0)
        running_max = new_max
        target_z += tl.sum(tl.where(cols == target, z, 0.0), 0)
    lse = running_max + tl.log(running_sum)
    tl.store(lse_ptr + row, lse)
    tl.store(logp_ptr + row, target_z - lse)


@triton.jit
def _backward_kernel(
    logits_ptr,
    bias_ptr,
    targets_ptr,
    lse_ptr,
    scale_ptr,
    vocab,
    stride,
    inv_t,
    HAS_BIAS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One program per (row, tile), in place: u -> dL/du = s ([j = t] - exp(z - lse))."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = cols < vocab
    ptrs = logits_ptr + row.to(tl.int64) * stride + cols
    u = tl.load(ptrs, mask=valid, other=0.0)
    if HAS_BIAS:
        u += tl.load(bias_ptr + cols, mask=valid, other=0.0)
    pi = tl.exp(u * inv_t - tl.load(lse_ptr + row))
    onehot = tl.where(cols == tl.load(targets_ptr + row), 1.0, 0.0)
    tl.store(ptrs, tl.load(scale_ptr + row) * (onehot - pi), mask=valid)


def _block_v(vocab: int) -> int:
    return min(MAX_BLOCK_V, triton.next_power_of_2(vocab))


def _forward_chunks(
    hidden: Tensor,
    weight32: Tensor,
    bias32: Tensor | None,
    targets: Tensor,
    chunk_size: int,
    temperature: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """log-probs (N,), lse (N,) and the (chunk, V) buffer, whose first rows hold the last chunk's u."""
    n, vocab = hidden.shape[0], weight32.shape[0]
    device = hidden.device
    logp = torch.empty(n, dtype=torch.float32, device=device)
    lse = torch.empty(n, dtype=torch.float32, device=device)
    buffer = torch.empty(min(chunk_size, n), vocab, dtype=torch.float32, device=device)
    targets = targets.contiguous()
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        u = torch.mm(hidden[start:end].float(), weight32.T, out=buffer[: end - start])  # (c, V)
        _forward_kernel[(end - start,)](
            u,
            bias32,
            targets[start:end],
            logp[start:end],
            lse[start:end],
            vocab,
            u.stride(0),
            1.0 / temperature,
            HAS_BIAS=bias32 is not None,
            BLOCK_V=_block_v(vocab),
        )
    return logp, lse, buffer


class _TritonTokenLogprobs(torch.autograd.Function):
    """Forward keeps (N,) log-probs and lse, and the last chunk's u; backward recomputes the other chunks."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, temperature):
        weight32 = weight.detach().float()
        bias32 = None if bias is None else bias.detach().float().contiguous()
        logp, lse, buffer = _forward_chunks(
            hidden.detach(), weight32, bias32, targets, chunk_size, temperature
        )
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.last_u = buffer
        ctx.chunk_size = chunk_size
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        return logp

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        last_u, ctx.last_u = ctx.last_u, None
        if grad_logp is None:
            return None, None, None, None, None, None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n, vocab = hidden.shape[0], weight.shape[0]
        chunk_size, temperature = ctx.chunk_size, ctx.temperature
        device = hidden.device
        weight32 = weight.detach().float()
        bias32 = None if bias is None else bias.detach().float().contiguous()
        hidden32 = hidden.detach().float()
        targets = targets.contiguous()
        scale = (grad_logp.float() / temperature).contiguous()  # s = g / T   (N,)
        grad_hidden = torch.empty(n, hidden.shape[1], dtype=torch.float32, device=device) if need_h else None
        # the first chunk writes grad_weight (no zero fill of a (V, H) block), the others accumulate
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=device) if need_w and n == 0 else None
        )
        grad_bias = torch.zeros(vocab, dtype=torch.float32, device=device) if need_b else None
        # a second backward (retain_graph) finds no buffer: it recomputes every chunk
        buffer = last_u if last_u is not None else torch.empty(min(chunk_size, n), vocab, device=device)
        starts = list(range(0, n, chunk_size))
        # the last chunk first: its u is still in the forward's buffer, no recompute
        for i, start in enumerate(starts[-1:] + starts[:-1]):
            end = min(start + chunk_size, n)
            c = end - start
            if i == 0 and last_u is not None:
                du = buffer[:c]
            else:
                du = torch.mm(hidden32[start:end], weight32.T, out=buffer[:c])
            grid = (c, triton.cdiv(vocab, _block_v(vocab)))
            _backward_kernel[grid](
                du,
                bias32,
                targets[start:end],
                lse[start:end],
                scale[start:end],
                vocab,
                du.stride(0),
                1.0 / temperature,
                HAS_BIAS=bias32 is not None,
                BLOCK_V=_block_v(vocab),
            )
            if need_h:
                torch.mm(du, weight32, out=grad_hidden[start:end])  # dL/dh = dL/du W   (c, H)
            if need_w:  # dL/dW = dL/du^T h   (V, H)
                if grad_weight is None:
                    grad_weight = torch.mm(du.T, hidden32[start:end])
                else:
                    grad_weight.addmm_(du.T, hidden32[start:end])
            if need_b:
                grad_bias += du.sum(0)
        del buffer, last_u
        return (
            None if grad_hidden is None else grad_hidden.to(hidden.dtype),
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
            None,
        )


def triton_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    chunk_size: int,
    temperature: float,
    lm_head_bias: Tensor | None,
    needs_grad: bool,
) -> Tensor:
    """(N,) float32 log pi(target); the arguments as ``gspo.core.logprobs.token_logprobs``, checked there."""
    check_device(hidden.device)
    if needs_grad:
        return _TritonTokenLogprobs.apply(hidden, weight, lm_head_bias, targets, chunk_size, temperature)
    bias32 = None if lm_head_bias is None else lm_head_bias.detach().float().contiguous()
    return _forward_chunks(
        hidden.detach(), weight.detach().float(), bias32, targets, chunk_size, temperature
    )[0]
