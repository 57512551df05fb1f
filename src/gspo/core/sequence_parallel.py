"""Sequence data parallelism (as in Fast-LLM): each rank of a group computes one slice of packed rows.

The rows' columns are cut into N contiguous slices of equal width (`split_micro_batch`); a rank runs the
decoder on its own slice. Inside `split_attention`, a supported model's attention all-gathers the keys and
values of every slice along the sequence (the caller's ``SequenceSplit.gather``, whose backward reduce-
scatters their gradients), so each local query sees every earlier token of its own segment, as in the
unsplit row. RoPE needs nothing more: each slice passes its own position_ids. Grouped-query heads are read
as sdpa's ``enable_gqa``; a layer's sliding window narrows the mask. The rank scores the tokens its hidden
states predict (columns lo+1..hi of its slice [lo, hi)), through the chunked LM head. The loss then
all-reduces each sequence's sums over the group (gspo.core.objectives' ``segment_sum_reduce``).

A slice's queries go in pieces, one per segment it holds: a segment starting inside the slice is plainly
causal and shares a padded batch with pieces of similar length (as gspo.core.attention); the one segment
per row continuing from an earlier slice also attends to that segment's earlier keys (lower-right aligned
causal: on CUDA torch's CausalBias, no mask; on CPU the flash kernel on the earlier keys and on the slice's
own, merged by their log-sum-exps; with sliding windows, masked blocks of queries recomputed in the
backward, so no (queries, keys) mask outlives its block). Only packed rows (position_ids
restarting at 0 for each sequence) are supported.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.attention.bias import causal_lower_right
from torch.utils.checkpoint import checkpoint
from transformers import AttentionInterface

from gspo.core.attention import BUCKET_RATIO, supports_segments
from gspo.core.layout import MicroBatch, SequenceSplit
from gspo.core.logprobs import _scored_positions, causal_lm_logprobs, decoder_and_head, token_logprobs

NAME = "gspo_sequence_split"
"""The attention implementation registered with transformers, active only inside split_attention."""


@dataclass(frozen=True)
class _Pieces:
    """Query pieces of one sdpa call: S pieces padded to Lq queries and Lk keys."""

    queries: Tensor  # (S * Lq,) local flat index b * P + (t - lo) of each query slot (padding repeats one)
    keys: Tensor  # (S * Lk,) gathered flat index b * T + t of each key slot
    keep: Tensor  # (n,) the query slots holding real tokens
    shape: tuple[int, int, int]  # (S, Lq, Lk)
    offset: int  # the pieces' first query minus their first key, in columns (0: plainly causal)


@dataclass(frozen=True)
class SliceLayout:
    """The pieces of a slice [lo, hi) of packed rows of width T, and where the local tokens land."""

    pieces: list[_Pieces]
    inverse: Tensor  # (B * P,) position of local token b * P + p among the pieces' kept slots
    split: SequenceSplit


_LAYOUT: contextvars.ContextVar[SliceLayout | None] = contextvars.ContextVar(NAME, default=None)


def _segment_pieces(
    position_ids: Tensor, lo: int, hi: int
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """The segments of packed rows (B, T) that columns [lo, hi) hold: those starting there, as (row, first
    column, length in the slice), and those continuing from an earlier slice, as (row, the segment's first
    column, its last column in the slice + 1)."""
    pos = position_ids.detach().cpu()
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    starting, continuing = [], []
    for b in range(pos.shape[0]):
        first = starts[b].nonzero().squeeze(1).tolist()
        for cs, ce in zip(first, [*first[1:], pos.shape[1]], strict=True):
            qs, qe = max(cs, lo), min(ce, hi)
            if qs < qe and qs == cs:
                starting.append((b, qs, qe - qs))
            elif qs < qe:
                continuing.append((b, cs, qe))
    return starting, continuing


def slice_layout(
    position_ids: Tensor, split: SequenceSplit, bucket_ratio: float = BUCKET_RATIO
) -> SliceLayout:
    """The pieces of this rank's slice of packed rows ``position_ids`` (B, T), whole rows on every rank."""
    width = position_ids.shape[1]
    lo, hi = split.bounds(width)
    part = hi - lo
    starting, continuing = _segment_pieces(position_ids, lo, hi)
    device = position_ids.device
    pieces, chosen = [], []

    def add(queries: Tensor, keys: Tensor, valid: Tensor, shape: tuple[int, int, int], offset: int) -> None:
        where = (queries.to(device), keys.to(device), valid.nonzero().squeeze(1).to(device))
        pieces.append(_Pieces(*where, shape, offset))
        chosen.append(queries[valid])

    for b, cs, qe in continuing:  # queries [lo, qe) against keys [cs, qe)
        every = torch.ones(qe - lo, dtype=torch.bool)
        add(
            b * part + torch.arange(qe - lo),
            b * width + torch.arange(cs, qe),
            every,
            (1, qe - lo, qe - cs),
            lo - cs,
        )
    order = sorted(starting, key=lambda piece: -piece[2])
    i = 0
    while i < len(order):  # causal pieces in buckets of similar lengths, right-padded
        longest = order[i][2]
        j = i
        while j < len(order) and order[j][2] * bucket_ratio >= longest:
            j += 1
        row, col, length = (torch.tensor(x)[:, None] for x in zip(*order[i:j], strict=True))
        slot = torch.arange(longest)[None, :]
        column = col + torch.minimum(slot, length - 1)  # (S, L): a padded slot repeats the last token
        queries, keys = (row * part + column - lo).reshape(-1), (row * width + column).reshape(-1)
        add(queries, keys, (slot < length).reshape(-1), (j - i, longest, longest), 0)
        i = j
    return SliceLayout(pieces, torch.argsort(torch.cat(chosen)).to(device), split)


QUERY_BLOCK = 32
"""Queries per sdpa call where a piece needs a mask: each block's (QUERY_BLOCK, keys) mask lives only
during its call, recomputed in the backward (activation checkpointing), so no (Lq, Lk) mask is ever held.
Small, because the CPU kernel's buffers for a masked call grow with QUERY_BLOCK x keys."""


LOWER_RIGHT_DEVICES = ("cuda",)
"""Where sdpa runs a lower-right causal CausalBias without materialising its mask (flash attention)."""


@dataclass(frozen=True)
class _Attend:
    """What every sdpa call of one layer shares."""

    dropout: float
    scale: float | None
    gqa: bool
    window: int | None  # transformers' sliding window: keys fewer than `window` columns back


def _block_attention(q: Tensor, k: Tensor, v: Tensor, offset: int, how: _Attend) -> Tensor:
    """sdpa of queries (S, H, c, D) against keys (S, Hkv, n, D): key j visible to query i where it lies
    0 <= i + offset - j (< window) columns back."""
    i = torch.arange(q.shape[2], device=q.device)[:, None]
    j = torch.arange(k.shape[2], device=q.device)[None, :]
    distance = i + offset - j
    visible = distance >= 0
    if how.window is not None:
        visible &= distance < how.window
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=visible, dropout_p=how.dropout, scale=how.scale, enable_gqa=how.gqa
    )


class _PrefixThenCausal(torch.autograd.Function):
    """CPU flash attention of queries (S, H, Lq, D) against keys that are all visible (a prefix, Lp) then
    causal (Lq, the queries' own): two kernel calls merged by their log-sum-exps, no mask. The backward
    calls the kernel's own backward on each part with the merged output and log-sum-exp, as ring attention
    does: each key block's gradient needs only those."""

    @staticmethod
    def forward(ctx, q: Tensor, k_prefix: Tensor, v_prefix: Tensor, k_own: Tensor, v_own: Tensor, scale):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out_prefix, lse_prefix = flash(q, k_prefix, v_prefix, 0.0, False, scale=scale)
        out_own, lse_own = flash(q, k_own, v_own, 0.0, True, scale=scale)
        lse = torch.logaddexp(lse_prefix, lse_own)  # (S, H, Lq)
        # out = sum_parts exp(lse_part - lse) out_part
        out = out_prefix * (lse_prefix - lse).exp().unsqueeze(-1) + out_own * (lse_own - lse).exp().unsqueeze(
            -1
        )
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k_prefix, v_prefix, k_own, v_own, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k_prefix, v_prefix, k_own, v_own, out, lse = ctx.saved_tensors
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        grad = grad.contiguous()
        dq_prefix, dk_prefix, dv_prefix = backward(
            grad, q, k_prefix, v_prefix, out, lse, 0.0, False, scale=ctx.scale
        )
        dq_own, dk_own, dv_own = backward(grad, q, k_own, v_own, out, lse, 0.0, True, scale=ctx.scale)
        return dq_prefix + dq_own, dk_prefix, dv_prefix, dk_own, dv_own, None


def _attend(q: Tensor, k: Tensor, v: Tensor, offset: int, how: _Attend) -> Tensor:
    """(S, H, Lq, Dv): query i sees key j where j <= i + offset (and within the window). Plainly causal:
    sdpa's is_causal. A lower-right causal piece (the keys before the queries, then the queries' own): on
    CUDA torch's CausalBias, which flash attention runs without a mask; on CPU `_PrefixThenCausal`.
    Otherwise (a sliding window, dropout elsewhere) masked blocks of queries, checkpointed (QUERY_BLOCK)."""
    lq, lk = q.shape[2], k.shape[2]
    sdpa = functools.partial(
        torch.nn.functional.scaled_dot_product_attention,
        dropout_p=how.dropout,
        scale=how.scale,
        enable_gqa=how.gqa,
    )
    if how.window is None and offset == 0:
        return sdpa(q, k, v, is_causal=True)
    if how.window is None and offset == lk - lq and q.device.type in LOWER_RIGHT_DEVICES:
        return sdpa(q, k, v, attn_mask=causal_lower_right(lq, lk))
    if how.window is None and offset == lk - lq and q.device.type == "cpu" and how.dropout == 0:
        if how.gqa:  # the CPU kernel wants as many key/value heads as query heads
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        return _PrefixThenCausal.apply(
            q, k[:, :, :offset], v[:, :, :offset], k[:, :, offset:], v[:, :, offset:], how.scale
        )
    blocks = []
    for start in range(0, lq, QUERY_BLOCK):
        end = min(start + QUERY_BLOCK, lq)
        last = min(lk, end + offset)  # keys past the block's last query are invisible to it
        first = 0 if how.window is None else max(0, start + offset - how.window + 1)
        blocks.append(
            checkpoint(
                _block_attention,
                q[:, :, start:end],
                k[:, :, first:last],
                v[:, :, first:last],
                start + offset - first,
                how,
                use_reentrant=False,
            )
        )
    return torch.cat(blocks, dim=2)


def _split_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers attention function on a slice: (B, H, P, D) queries, (B, Hkv, P, D) keys, (B, Hkv, P, Dv)
    values of the local columns -> (B, P, H, Dv), each query against its segment's keys on every rank."""
    layout = _LAYOUT.get()
    if layout is None:
        raise RuntimeError(
            f"the {NAME!r} attention runs only inside gspo.core.sequence_parallel.split_attention"
        )
    if kwargs.get("softcap") is not None:
        raise NotImplementedError(f"{NAME!r}: attention soft-capping is not supported")
    batch, heads, part, _ = query.shape
    kv_heads, key_dim, value_dim = key.shape[1], key.shape[-1], value.shape[-1]
    # one collective for both: (B, Hkv, T, D + Dv), every slice in order
    key, value = layout.split.gather(torch.cat([key, value], dim=-1)).split([key_dim, value_dim], dim=-1)
    width = key.shape[2]
    q = query.transpose(1, 2).reshape(batch * part, heads, -1)
    k = key.transpose(1, 2).reshape(batch * width, kv_heads, key_dim)
    v = value.transpose(1, 2).reshape(batch * width, kv_heads, value_dim)
    how = _Attend(dropout, scaling, kv_heads != heads, kwargs.get("sliding_window"))
    outputs = []
    for pieces in layout.pieces:
        count, lq, lk = pieces.shape
        out = _attend(
            q.index_select(0, pieces.queries).view(count, lq, heads, -1).transpose(1, 2),
            k.index_select(0, pieces.keys).view(count, lk, kv_heads, -1).transpose(1, 2),
            v.index_select(0, pieces.keys).view(count, lk, kv_heads, -1).transpose(1, 2),
            pieces.offset,
            how,
        )  # (S, H, Lq, Dv)
        outputs.append(out.transpose(1, 2).reshape(-1, heads, value_dim).index_select(0, pieces.keep))
    merged = torch.cat(outputs).index_select(0, layout.inverse)  # (B*P, H, Dv) in local token order
    return merged.view(batch, part, heads, value_dim), None


AttentionInterface.register(NAME, _split_attention_forward)


def supports_split(model: nn.Module) -> bool:
    """Whether `split_attention` can take over this model's attention: what gspo.core.attention supports,
    and models with sliding windows."""
    config = model.config
    if getattr(config, "sliding_window", None) is None:
        return supports_segments(model)
    saved = config.sliding_window
    try:
        config.sliding_window = None  # the window is the one thing segment attention lacks
        return supports_segments(model)
    finally:
        config.sliding_window = saved


@contextlib.contextmanager
def split_attention(model: nn.Module, position_ids: Tensor, split: SequenceSplit) -> Iterator[None]:
    """Within the block, ``model``'s attention computes this rank's slice of packed rows ``position_ids``
    (B, T, whole rows) against every slice's keys and values; raises for a model it does not support."""
    if not supports_split(model):
        raise ValueError(
            f"{type(model).__name__}'s attention cannot be split along the sequence (it needs sdpa or eager "
            "attention through transformers' AttentionInterface, without soft-capping or gradient "
            "checkpointing): set distributed.sequence_parallel=1"
        )
    config = model.config
    token = _LAYOUT.set(slice_layout(position_ids, split))
    previous = config._attn_implementation
    config._attn_implementation = NAME  # transformers then builds no mask of its own
    try:
        yield
    finally:
        config._attn_implementation = previous
        _LAYOUT.reset(token)


def split_causal_lm_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    *,
    position_ids: Tensor,
    split: SequenceSplit,
    logprob_mask: Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    kernel: str = "torch",
    **unused: Any,
) -> Tensor:
    """gspo.core.logprobs.causal_lm_logprobs of packed rows (B, T) for this rank's slice [lo, hi): (B, T)
    float32, the log-probs of the tokens in columns lo+1..hi (those its hidden states predict), 0
    elsewhere. Every rank of the group passes the same whole rows and calls it together."""
    decoder, head = decoder_and_head(model)
    batch, width = input_ids.shape
    lo, hi = split.bounds(width)
    with split_attention(decoder, position_ids, split):
        hidden = decoder(
            input_ids=input_ids[:, lo:hi], position_ids=position_ids[:, lo:hi], use_cache=False
        ).last_hidden_state  # (B, P, H)
    scored = _scored_positions(input_ids, None, position_ids, logprob_mask) & owned_columns(
        width, split, input_ids.device
    )
    flat_pos = scored.flatten().nonzero().squeeze(1)  # (n,) b * T + t with lo < t <= hi
    row, column = flat_pos // width, flat_pos % width
    predecessor = row * (hi - lo) + column - 1 - lo  # the local hidden state at t - 1 predicts token t
    values = token_logprobs(
        hidden.flatten(0, 1).index_select(0, predecessor),
        head.weight,
        input_ids.flatten().index_select(0, flat_pos),
        chunk_size=chunk_size,
        temperature=temperature,
        lm_head_bias=head.bias,
        kernel=kernel,
    )
    dense = torch.zeros(batch * width, dtype=torch.float32, device=input_ids.device)
    return dense.index_put((flat_pos,), values).view(batch, width)


def owned_columns(width: int, split: SequenceSplit, device: torch.device | None = None) -> Tensor:
    """(1, T) bool: the columns whose tokens this rank scores, lo+1..hi (column 0 has no predecessor)."""
    lo, hi = split.bounds(width)
    columns = torch.arange(width, device=device)
    return ((columns > lo) & (columns <= hi)).unsqueeze(0)


def lm_logprobs(
    model: nn.Module, input_ids: Tensor, *, split: SequenceSplit | None = None, **kwargs: Any
) -> Tensor:
    """causal_lm_logprobs, or its slice under sequence data parallelism (``split``)."""
    if split is None:
        return causal_lm_logprobs(model, input_ids, **kwargs)
    return split_causal_lm_logprobs(model, input_ids, split=split, **kwargs)


def split_micro_batch(mb: MicroBatch, split: SequenceSplit, pad_id: int) -> MicroBatch:
    """``mb`` for this rank of a sequence-parallel group: rows right-padded to a multiple of the group's
    size (the padding a segment of its own that nothing attends to or scores), and trained only on the
    tokens this rank scores (`owned_columns`: segment_ids -1 elsewhere)."""
    if mb.prefix_tree or mb.attention_mask is not None:
        raise ValueError("sequence data parallelism splits packed rows only: set train.layout=packed")
    rows, width = mb.input_ids.shape
    extra = -width % split.size
    input_ids, position_ids, logprob_mask = mb.input_ids, mb.position_ids, mb.logprob_mask
    segment_ids = mb.segment_ids.view(rows, width)
    if extra:

        def pad(x: Tensor, value: int | bool) -> Tensor:
            return torch.cat([x, torch.full((rows, extra), value, dtype=x.dtype, device=x.device)], dim=1)

        input_ids, logprob_mask, segment_ids = (
            pad(input_ids, pad_id),
            pad(logprob_mask, False),
            pad(segment_ids, -1),
        )
        tail = torch.arange(extra, device=position_ids.device).expand(rows, extra)
        position_ids = torch.cat([position_ids, tail], dim=1)
    owned = owned_columns(width + extra, split, segment_ids.device)
    return dataclasses.replace(
        mb,
        input_ids=input_ids,
        position_ids=position_ids,
        logprob_mask=logprob_mask,
        segment_ids=torch.where(owned, segment_ids, -1).reshape(-1),
        split=split,
    )
