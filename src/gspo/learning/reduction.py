"""Metrics reduced over micro-batches, minibatches and ranks, read back from the device once."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch


def tensors_to_floats(tensors: Sequence[torch.Tensor]) -> list[float]:
    """Python floats of single-element tensors, one device sync per device rather than one per tensor."""
    out: list[float] = [0.0] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel() != 1:
            raise ValueError(f"expected a single-element tensor, got shape {tuple(t.shape)}")
        by_device.setdefault(t.device, []).append(i)
    for device, indices in by_device.items():
        dtype = torch.float32 if device.type == "mps" else torch.float64
        stacked = torch.stack([tensors[i].detach().reshape(()).to(dtype) for i in indices])
        for i, value in zip(indices, stacked.tolist(), strict=True):
            out[i] = value
    return out


def reduce_metrics(items: list[Mapping[str, Any]]) -> dict[str, float]:
    """Each key over the items that have it: the mean, except extremes (min of *_min, max of *_max, over
    the finite ones; 0 when none is) and counts (sum of num_*). Tensors are read back together, with one device sync.

    >>> reduce_metrics([{"loss": torch.tensor(1.0), "ratio_max": 2.0}, {"loss": 3.0, "ratio_max": 5.0}])
    {'loss': 2.0, 'ratio_max': 5.0}
    >>> reduce_metrics([{"ratio_min": float("inf")}, {"ratio_min": 0.9}, {"ratio_max": float("-inf")}])
    {'ratio_min': 0.9, 'ratio_max': 0.0}
    """
    tensors = [
        (i, key, v) for i, m in enumerate(items) for key, v in m.items() if isinstance(v, torch.Tensor)
    ]
    floats = [{key: v for key, v in m.items() if not isinstance(v, torch.Tensor)} for m in items]
    for (i, key, _), value in zip(tensors, tensors_to_floats([v for *_, v in tensors]), strict=True):
        floats[i][key] = value
    out: dict[str, float] = {}
    for key in dict.fromkeys(key for m in items for key in m):
        values = [float(m[key]) for m in floats if key in m]
        if key.endswith(("_min", "_max")):
            measured = [v for v in values if math.isfinite(v)]  # +-inf: an item that measured nothing
            out[key] = (min if key.endswith("_min") else max)(measured, default=0.0)
        elif key.startswith("num_"):
            out[key] = sum(values)
        else:
            out[key] = sum(values) / len(values)
    return out
