"""Sequence data-parallel groups: N consecutive ranks train on the same rows, one slice of each row per rank.

Ranks r with the same r // N form a group (data rank r // N); the groups are data-parallel to each other,
and the DDP or FSDP2 wrapper spans every rank, so each parameter's gradient is summed over all of them.
Inside a group, keys and values are all-gathered along the sequence (`gather_sequence`: its backward
reduce-scatters their gradients) and each sequence's loss sums are all-reduced (`SequenceGroup.
segment_sum_reduce`). docs/distributed.md explains why N ranks then make the one-process update.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gspo.config import ConfigError
from gspo.core.layout import SequenceSplit
from gspo.parallel.group import rank, world_size


@dataclass(frozen=True)
class SequenceGroup:
    """This rank's sequence-parallel group: ``size`` ranks, this one ``index``-th among them; the group is
    ``data_rank``-th of ``data_size`` data-parallel groups."""

    size: int
    index: int
    data_rank: int
    data_size: int
    group: Any  # dist.ProcessGroup

    @property
    def leads(self) -> bool:
        """The group's first rank: it alone counts what every rank of the group holds (sequences, tokens)."""
        return self.index == 0

    @property
    def split(self) -> SequenceSplit:
        return SequenceSplit(self.index, self.size, functools.partial(gather_sequence, group=self.group))

    @property
    def segment_sum_reduce(self) -> Callable[[Tensor], Tensor]:
        """compute_loss's differentiable all-reduce of the per-sequence sums, over this group."""
        return functools.partial(all_reduce_sum, group=self.group)

    def all_gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's object of this group, in group order."""
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out


_GROUPS: dict[tuple[int, int], SequenceGroup] = {}


def sequence_group(size: int) -> SequenceGroup | None:
    """This rank's group of ``size`` consecutive ranks (None for size 1). The first call is a collective
    (every rank creates every group, in the same order); later ones return the same group."""
    if size == 1:
        return None
    world = world_size()
    if world % size:
        raise ConfigError(
            f"distributed.sequence_parallel={size} does not divide the {world} processes: launch a multiple "
            f"of {size} processes, or set it to a divisor of {world}"
        )
    key = (size, id(dist.group.WORLD))
    if key not in _GROUPS:
        groups = [dist.new_group(list(range(g * size, (g + 1) * size))) for g in range(world // size)]
        me = rank()
        _GROUPS[key] = SequenceGroup(size, me % size, me // size, world // size, groups[me // size])
    return _GROUPS[key]


class _GatherSequence(torch.autograd.Function):
    """(B, h, P, D) -> (B, h, N P, D): every rank's slice along dim 2, in group order. Backward: each
    slice's gradient is the sum over the ranks of their gradients for it (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        size, index = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        if dist.get_backend(ctx.group) == dist.Backend.NCCL:
            out = torch.empty_like(grad.chunk(size, dim=2)[index], memory_format=torch.contiguous_format)
            dist.reduce_scatter(out, [c.contiguous() for c in grad.chunk(size, dim=2)], group=ctx.group)
            return out, None
        # gloo has no reduce-scatter: all-reduce the whole gradient and keep this rank's slice
        total = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=ctx.group)
        return total.chunk(size, dim=2)[index].contiguous(), None


class _AllReduceSum(torch.autograd.Function):
    """The sum over the group's ranks; its gradient is the sum of the ranks' gradients (each rank's loss
    depends on every rank's input through the sum). torch.distributed.nn's all_reduce, which is deprecated."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        total = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        total = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=ctx.group)
        return total, None


def all_reduce_sum(x: Tensor, *, group: Any) -> Tensor:
    """The sum of ``x`` over the group's ranks, differentiably."""
    return _AllReduceSum.apply(x, group)


def gather_sequence(x: Tensor, *, group: Any) -> Tensor:
    """Every rank's slice of ``x`` (B, h, P, D) concatenated along dim 2 in group order, differentiably."""
    return _GatherSequence.apply(x, group)
