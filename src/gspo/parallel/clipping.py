"""Gradient-norm clipping over all ranks' shards, folded into torch's fused AdamW step where it can be."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def clip_grad_norm(
    parameters: list[nn.Parameter], max_norm: float, optimizer: torch.optim.Optimizer | None = None
) -> Tensor:
    """Clip to a total gradient norm, the norm taken over all ranks' shards (DTensor) when sharded.

    With a fused ``optimizer`` (torch's fused AdamW) and plain tensors, the gradients are not rescaled
    here: the factor goes to the optimizer's next step as its ``grad_scale`` (the attribute GradScaler
    sets), which the fused kernel divides each gradient by as it reads it. The update is
    ``clip_grad_norm_``'s, without its read-and-write pass over every gradient.
    """
    if not parameters or not hasattr(parameters[0], "device_mesh"):  # plain tensors
        if optimizer is None or not optimizer.defaults.get("fused"):
            return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        grads = [p.grad for p in parameters if p.grad is not None]
        total = total_norm(grads) if grads else torch.zeros(())
        # clip_grad_norm_ multiplies by min(1, max_norm / (total + 1e-6)): divide by its inverse
        # (float32 whatever the gradients' dtype: the fused kernel reads it as such); the caller
        # removes it after the step (``release_grad_scale``), as GradScaler does
        optimizer.grad_scale = ((total.float() + 1e-6) / max_norm).clamp(min=1.0)
        return total
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total = torch.nn.utils.get_total_norm(grads)
    if hasattr(total, "full_tensor"):  # FSDP2: a partial norm per shard, reduced here
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total


BLOCK = 1024
"""Elements per float32 partial sum in :func:`total_norm` (its error bound is (BLOCK - 1) * 2^-24)."""


def total_norm(grads: list[Tensor]) -> Tensor:
    """The 2-norm of all ``grads`` together, as ``torch.nn.utils.get_total_norm`` (float32, a 0-dim tensor).

    Float32 CPU gradients: the sum of squares of each block of ``BLOCK`` consecutive values in float32 (one
    batched BLAS product), the block sums added in float64. Whatever the CPU, BLAS build, instruction set
    or thread count sums a block in, its relative error is at most (BLOCK - 1) * 2^-24 = 6.1e-5 (n
    non-negative terms in any order); with independent rounding errors it is about 2^-24 * sqrt(BLOCK /
    blocks), below float32's own rounding of the result for any tensor of a few blocks. One BLAS dot over a
    whole tensor has no such bound: over 4M values it was 7e-5 off on an AVX2-only AMD EPYC. Elsewhere (GPUs,
    other dtypes) torch's own. Speed: benchmarks/grad_norm.py.
    """
    if any(g.device.type != "cpu" or g.dtype != torch.float32 or g.is_sparse for g in grads):
        return torch.nn.utils.get_total_norm(grads)
    squares = []
    for g in grads:
        flat = g.reshape(-1)
        whole = flat.numel() - flat.numel() % BLOCK
        blocks = flat[:whole].view(-1, 1, BLOCK)  # (B, 1, BLOCK)
        squares.append(torch.bmm(blocks, blocks.transpose(1, 2)).sum(dtype=torch.float64))
        rest = flat[whole:]  # (< BLOCK,)
        squares.append(torch.dot(rest, rest).double())
    return torch.stack(squares).sum().sqrt().float()


def release_grad_scale(optimizer: torch.optim.Optimizer) -> None:
    """Forget a clipping factor :func:`clip_grad_norm` handed to ``optimizer`` once its step used it."""
    if hasattr(optimizer, "grad_scale"):
        del optimizer.grad_scale
