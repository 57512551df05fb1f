"""Attention for packed rows, one segment at a time: no FLOPs on the masked-out blocks.

Inside :func:`segment_attention`, a supported model's attention gathers each segment's queries, keys and
values into a batch of segments (buckets of similar lengths, right-padded), runs sdpa on it and scatters
the outputs back: exactly the block-diagonal attention, without computing the blocks it masks out. A
segment is one sequence (causal), or a prefix tree of sequences in depth-first order (gspo.core.layout's
shared_prefix rows), where a token sees its ancestors and itself: the earlier tokens of its own sequence.
docs/logprobs.md says which models are supported.
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
    mask: Tensor | None  # (S, 1, L, L) bool, key visible to query, for trees that branch; None: causal


@dataclass(frozen=True)
class SegmentLayout:
    """Where each packed segment's tokens are, grouped into buckets of similar lengths."""

    buckets: list[_Bucket]
    inverse: Tensor  # (B * T,) position of token b * T + t among the buckets' valid slots, in order


_LAYOUT: contextvars.ContextVar[SegmentLayout | None] = contextvars.ContextVar("gspo_segments", default=None)


def segment_layout(
    position_ids: Tensor, prefix_tree: bool = False, bucket_ratio: float = BUCKET_RATIO
) -> SegmentLayout:
    """The segments of packed rows. A segment starts at each row start and wherever the position does not
    continue the previous one (position_ids restart at 0 for each sequence); with ``prefix_tree`` a segment
    is a tree in depth-first order, position_ids the depth, starting where the position is 0."""
    rows, width = position_ids.shape
    pos = position_ids.detach().cpu()
    starts = torch.ones_like(pos, dtype=torch.bool)
    continues = pos[:, 1:] == pos[:, :-1] + 1
    starts[:, 1:] = pos[:, 1:] == 0 if prefix_tree else ~continues
    flat_starts = starts.reshape(-1)
    first = flat_starts.nonzero().squeeze(1)  # (S,) flat index of each segment's first token
    ends = torch.cat([first[1:], torch.tensor([rows * width])])
    # a segment never crosses a row: each row's first token starts one
    lengths = (ends - first).tolist()
    # a tree that branches (a token not continuing its predecessor inside the segment) needs a mask
    branches = torch.zeros_like(pos, dtype=torch.bool)
    branches[:, 1:] = ~continues & ~starts[:, 1:]
    segment = flat_starts.long().cumsum(0) - 1
    branching = torch.zeros(len(lengths), dtype=torch.long).index_add_(
        0, segment, branches.reshape(-1).long()
    )
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
        if bool(branching[members].any()):
            mask = _ancestor_mask(pos.reshape(-1)[gather].view(j - i, longest)).unsqueeze(1).to(device)
        buckets.append(
            _Bucket(gather.to(device), valid.nonzero().squeeze(1).to(device), j - i, longest, mask)
        )
        chosen.append(gather[valid])
        i = j
    return SegmentLayout(buckets, torch.argsort(torch.cat(chosen)).to(device))


def _ancestor_mask(depth: Tensor) -> Tensor:
    """(S, L, L) bool, [s, q, k]: key k is query q or an ancestor of it, in trees laid out depth-first
    whose tokens have depths ``depth`` (S, L). k's subtree is the tokens after it up to the first one no
    deeper than k, so k is an ancestor of q when k < q and no token in (k, q] is as shallow as k."""
    length = depth.shape[1]
    slot = torch.arange(length)
    after = slot[None, :] > slot[:, None]  # [k, j]: j after k
    closes = (depth[:, None, :] <= depth[:, :, None]) & after  # [s, k, j]: j ends k's subtree
    end = torch.where(closes.any(-1), closes.to(torch.uint8).argmax(-1), length)  # (S, L) first such j
    return (slot[None, None, :] <= slot[None, :, None]) & (slot[None, :, None] < end[:, None, :])


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
    model: torch.nn.Module, position_ids: Tensor, prefix_tree: bool = False
) -> Iterator[bool]:
    """Within the block, ``model``'s attention runs one packed segment at a time (yields True), or,
    for a model it does not support, is left as it is (yields False; prefix-tree rows then raise: only
    segment attention computes them). ``model``: a transformers PreTrainedModel (the decoder or the causal
    LM) whose config the block switches and restores."""
    if not supports_segments(model):
        if prefix_tree:
            raise ValueError(
                f"{type(model).__name__}'s attention cannot compute shared-prefix rows (it needs sdpa or eager "
                "attention through transformers' AttentionInterface): set train.layout=packed"
            )
        yield False
        return
    config = model.config
    token = _LAYOUT.set(segment_layout(position_ids, prefix_tree))
    previous = config._attn_implementation
    config._attn_implementation = NAME  # also skips transformers' mask: it builds none for unknown names
    try:
        yield True
    finally:
        config._attn_implementation = previous
        _LAYOUT.reset(token)
