"""Attention for packed rows, one segment at a time: no FLOPs on the masked-out blocks.

Inside :func:`segment_attention`, a supported model's attention gathers each segment's queries, keys and
values into a batch of segments (buckets of similar lengths, right-padded), runs sdpa on it and scatters
the outputs back: exactly the block-diagonal attention, without computing the blocks it masks out. A
segment is one sequence (causal), or a shared-prefix tree: a prompt and the completions that follow it,
each completion seeing the prompt and itself only. docs/logprobs.md says which models are supported.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import AttentionInterface

NAME = "gspo_segments"
"""The attention implementation registered with transformers, active only inside segment_attention."""
BUCKET_RATIO = 1.25
"""Segments share a padded batch when their lengths are within this factor of its longest one."""


@dataclass(frozen=True)
class _Bucket:
    gather: Tensor  # (S * L,) flat token index b * T + t of each slot (a padded slot repeats a real one)
    keep: Tensor  # (n,) the slots holding the segments' own tokens (index_select: a cheap backward)
    segments: int
    length: int
    mask: Tensor | None  # (S, 1, L, L) bool for trees with several completions; None: causal


@dataclass(frozen=True)
class SegmentLayout:
    """Where each packed segment's tokens are, grouped into buckets of similar lengths."""

    buckets: list[_Bucket]
    inverse: Tensor  # (B * T,) position of token b * T + t among the buckets' valid slots, in order


_LAYOUT: contextvars.ContextVar[SegmentLayout | None] = contextvars.ContextVar("gspo_segments", default=None)


def segment_layout(
    position_ids: Tensor, branch_ids: Tensor | None = None, bucket_ratio: float = BUCKET_RATIO
) -> SegmentLayout:
    """The segments of packed rows. Without ``branch_ids`` a segment starts at each row start and wherever
    the position does not continue the previous one (position_ids restart at 0 for each sequence); with
    them (shared-prefix rows) a segment is a tree, starting where the position is 0, and a token sees the
    earlier tokens of its tree's prompt (branch 0) and of its own branch."""
    rows, width = position_ids.shape
    pos = position_ids.detach().cpu()
    starts = torch.ones_like(pos, dtype=torch.bool)
    if branch_ids is None:
        starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    else:
        starts[:, 1:] = pos[:, 1:] == 0
        branches = branch_ids.detach().cpu().reshape(-1)
    first = starts.reshape(-1).nonzero().squeeze(1)  # (S,) flat index of each segment's first token
    ends = torch.cat([first[1:], torch.tensor([rows * width])])
    # a segment never crosses a row: each row's first token starts one
    lengths = (ends - first).tolist()
    order = sorted(range(len(lengths)), key=lambda s: -lengths[s])
    device = position_ids.device
    buckets, chosen = [], []
    i = 0
    while i < len(order):
        longest = lengths[order[i]]
        j = i
        while j < len(order) and lengths[order[j]] * bucket_ratio >= longest:
            j += 1
        members = torch.tensor(order[i:j])
        seg_start, seg_len = first[members, None], torch.tensor([lengths[s] for s in order[i:j]])[:, None]
        slot = torch.arange(longest)[None, :]  # (1, L)
        valid = (slot < seg_len).reshape(-1)
        gather = (seg_start + torch.minimum(slot, seg_len - 1)).reshape(-1)
        mask = None
        if branch_ids is not None:
            branch = branches[gather].view(j - i, longest)  # (S, L)
            if bool((branch > 1).any()):  # a tree with several completions: not plain causal
                # query q sees key k <= q of the prompt (branch 0) or of its own branch   (S, 1, L, L)
                same = (branch[:, None, :] == 0) | (branch[:, None, :] == branch[:, :, None])
                mask = (same & torch.ones(longest, longest, dtype=torch.bool).tril()).unsqueeze(1).to(device)
        buckets.append(
            _Bucket(gather.to(device), valid.nonzero().squeeze(1).to(device), j - i, longest, mask)
        )
        chosen.append(gather[valid])
        i = j
    return SegmentLayout(buckets, torch.argsort(torch.cat(chosen)).to(device))


def _segment_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers attention function: (B, H, T, D) queries and keys, (B, Hkv, T, Dv) values (Hkv
    dividing H, Dv possibly not D, as in DeepSeek-V3) -> (B, T, H, Dv)."""
    layout = _LAYOUT.get()
    if layout is None:
        raise RuntimeError(f"the {NAME!r} attention runs only inside gspo.core.attention.segment_attention")
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise NotImplementedError(f"{NAME!r}: sliding windows and soft-capping are not supported")
    batch, heads, width, _ = query.shape
    value_dim = value.shape[-1]
    q = query.transpose(1, 2).reshape(batch * width, heads, -1)
    k = key.transpose(1, 2).reshape(batch * width, key.shape[1], -1)
    v = value.transpose(1, 2).reshape(batch * width, value.shape[1], value_dim)
    outputs = []
    for bucket in layout.buckets:
        shape = (bucket.segments, bucket.length)

        def take(x: Tensor, bucket: _Bucket = bucket, shape: tuple[int, int] = shape) -> Tensor:
            # (S, L, h, D) -> (S, h, L, D)
            return x.index_select(0, bucket.gather).view(*shape, *x.shape[1:]).transpose(1, 2)

        # grouped-query attention: query head h reads key/value head h // (H / Hkv), as transformers'
        # repeat_kv, without the copy (enable_gqa)
        out = torch.nn.functional.scaled_dot_product_attention(
            take(q),
            take(k),
            take(v),
            attn_mask=bucket.mask,
            dropout_p=dropout,
            is_causal=bucket.mask is None,
            scale=scaling,
            enable_gqa=k.shape[1] != heads,
        )  # (S, H, L, Dv)
        outputs.append(out.transpose(1, 2).reshape(-1, heads, value_dim).index_select(0, bucket.keep))
    merged = torch.cat(outputs).index_select(0, layout.inverse)  # (B*T, H, Dv) in token order
    return merged.view(batch, width, heads, value_dim), None


AttentionInterface.register(NAME, _segment_attention_forward)


def supports_segments(model: torch.nn.Module) -> bool:
    """Whether :func:`segment_attention` can take over this model's attention (see the module docstring)."""
    config = model.config
    implementation = getattr(config, "_attn_implementation", None)
    checkpointing = any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    return (
        # the model's attention layers dispatch through AttentionInterface (models with attention code
        # of their own, e.g. GPT-J or Falcon, would silently lose their mask under an unknown name)
        getattr(type(model), "_supports_attention_backend", False)
        and implementation in ("sdpa", "eager")
        and not getattr(config, "sub_configs", None)
        and getattr(config, "sliding_window", None) is None
        and getattr(config, "attn_logit_softcapping", None) is None
        and not checkpointing
    )


@contextlib.contextmanager
def segment_attention(
    model: torch.nn.Module, position_ids: Tensor, branch_ids: Tensor | None = None
) -> Iterator[bool]:
    """Within the block, ``model``'s attention runs one packed segment at a time (yields True), or,
    for a model it does not support, is left as it is (yields False; shared-prefix rows, ``branch_ids``,
    then raise: only segment attention computes them). ``model``: a transformers PreTrainedModel (the
    decoder or the causal LM) whose config the block switches and restores."""
    if not supports_segments(model):
        if branch_ids is not None:
            raise ValueError(
                f"{type(model).__name__}'s attention cannot compute shared-prefix rows (it needs sdpa or eager "
                "attention through transformers' AttentionInterface): set train.packing=packed"
            )
        yield False
        return
    config = model.config
    token = _LAYOUT.set(segment_layout(position_ids, branch_ids))
    previous = config._attn_implementation
    config._attn_implementation = NAME  # also skips transformers' mask: it builds none for unknown names
    try:
        yield True
    finally:
        config._attn_implementation = previous
        _LAYOUT.reset(token)
