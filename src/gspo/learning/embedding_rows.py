"""The gradient of an input embedding tied to the LM head, added row by row into the head's.

autograd's embedding backward writes a dense (vocab x hidden) gradient, zeros except the rows of the
tokens seen, and adds it to the head's dense gradient: for SmolLM2 a 113 MB zero fill, a 113 MB tensor and
an add of two per backward, for a few hundred rows. `TiedRows` instead gives the decoder the embedded
tokens as a leaf of their own (the same values); after the backward it adds their gradient to the
weight's rows in place (``index_add_``), the gradient the weight would have had, summed in another order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn


class TiedRows:
    """Records the embedded tokens of the passes run under `recording`; `add_to_grad` moves their gradient
    into the weight's. ``enabled`` only for a plain ``nn.Embedding`` whose trainable weight is the LM head's,
    in one process (DDP and FSDP2 reduce gradients inside the backward, before `add_to_grad` could)."""

    def __init__(self, model: nn.Module, *, one_process: bool) -> None:
        embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
        self.enabled = (
            one_process
            and type(embedding) is nn.Embedding
            and embedding.max_norm is None  # max_norm renormalises the weight's rows in the lookup
            and not embedding.scale_grad_by_freq
            and not embedding.sparse
            and head is not None
            and head.weight is embedding.weight
            and embedding.weight.requires_grad
            # a plain tensor: FSDP2's parameters are DTensors, whose gradients arrive sharded and reduced
            and type(embedding.weight.data) is Tensor
        )
        self.embedding = embedding
        self.rows: list[tuple[Tensor, Tensor]] = []  # (token ids, their embeddings as a leaf)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Passes run inside embed their tokens through a leaf tensor (passes without grad as usual)."""
        if not self.enabled:
            yield
            return
        self.rows = []  # a pass that failed before its backward left rows no gradient reached
        handle = self.embedding.register_forward_hook(self._leaf)
        try:
            yield
        finally:
            handle.remove()

    def _leaf(self, module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> Tensor | None:
        if not torch.is_grad_enabled():
            return None
        leaf = output.detach().requires_grad_()
        self.rows.append((args[0], leaf))
        return leaf

    def add_to_grad(self) -> None:
        """After the backward: each recorded token's embedding gradient into its row of the weight's."""
        weight, pad = self.embedding.weight, self.embedding.padding_idx
        for ids, leaf in self.rows:
            if leaf.grad is None:  # the loss did not depend on it
                continue
            ids, grad = ids.reshape(-1), leaf.grad.reshape(-1, leaf.shape[-1])
            if pad is not None:  # the padding row gets no gradient (nn.Embedding's padding_idx)
                keep = ids != pad
                ids, grad = ids[keep], grad[keep]
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            weight.grad.index_add_(0, ids, grad)
        self.rows = []
