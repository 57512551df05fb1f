"""Collectives on plain values, in rank order; each is the identity in a single process."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gspo.parallel.group import world_size


def _device() -> torch.device:
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def all_reduce_sum(value: float) -> float:
    """Sum of a number over the ranks (float64, so counts stay exact)."""
    if world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=_device())
    dist.all_reduce(t)
    return float(t.item())


def all_reduce_sums(values: list[float]) -> list[float]:
    """Element-wise sum of a list of numbers over the ranks, in one collective (float64)."""
    if world_size() == 1 or not values:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=_device())
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_max(values: list[int]) -> list[int]:
    """Element-wise maximum of an integer list over the ranks."""
    if world_size() == 1 or not values:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def all_gather_cat(t: Tensor) -> Tensor:
    """Concatenate a tensor of the same shape on every rank along dim 0, in rank order."""
    if world_size() == 1:
        return t
    parts = [torch.empty_like(t, device=_device()) for _ in range(world_size())]
    dist.all_gather(parts, t.to(_device()).contiguous())
    return torch.cat(parts).to(t.device)


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's picklable object, in rank order."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def all_gather_list(items: list[Any]) -> list[Any]:
    """Concatenation of every rank's list, in rank order."""
    return [x for part in all_gather_objects(list(items)) for x in part]


def all_gather_varlen(t: Tensor) -> Tensor:
    """Concatenate 1-D tensors of any lengths from every rank, in rank order."""
    if world_size() == 1:
        return t
    return torch.cat([part.to(t.device) for part in all_gather_objects(t.detach().cpu())])


def all_gather_metrics(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's list of metric dicts (values made floats), concatenated in rank order."""
    if world_size() == 1:
        return items
    return all_gather_list([{k: float(v) for k, v in m.items()} for m in items])


def broadcast_object(obj: Any) -> Any:
    """Rank 0's object on every rank."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def raise_together(error: Exception | None) -> None:
    """Raise on every rank when any rank failed: the failing rank its own error, the others one of the
    same type naming that rank.

    Without this a failing rank leaves the others blocked in their next collective; with it every rank
    reaches the failure handler together (which may itself use collectives, e.g. to checkpoint).
    """
    failures = all_gather_objects(None if error is None else (type(error), str(error)))
    if error is not None:
        raise error
    for source, failure in enumerate(failures):
        if failure is not None:
            kind, message = failure
            try:
                other = kind(f"on rank {source}: {message}")
            except Exception:  # an exception type with a different constructor
                other = RuntimeError(f"{kind.__name__} on rank {source}: {message}")
            raise other
