"""The trainable weights of a model, copied: the one road by which a copy of the policy (the sampling side's
own, a train call's snapshot to roll back to) is taken and brought up to date."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def trainable(model: nn.Module) -> list[torch.Tensor]:
    """The parameters that training changes, detached, in the model's order (LoRA: the adapters)."""
    return [p.detach() for p in model.parameters() if p.requires_grad]


@torch.no_grad()
def copy_weights(
    source: nn.Module | Sequence[torch.Tensor], into: nn.Module | Sequence[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """The trainable weights of ``source`` (a model, or tensors taken from one) copied into ``into`` (a model
    of the same architecture, or tensors of the same shapes; None: fresh tensors); returns the copies."""
    values = trainable(source) if isinstance(source, nn.Module) else list(source)
    if into is None:
        return [v.clone() for v in values]
    targets = trainable(into) if isinstance(into, nn.Module) else list(into)
    torch._foreach_copy_(targets, values)
    return targets
