"""Sequence data parallelism (as in Fast-LLM): each rank of a group computes one slice of packed rows.

The rows' columns are cut into N contiguous slices of equal width (`split_micro_batch`); a rank runs the
decoder on its own slice. Inside `split_attention`, each local query attends to the earlier tokens of its
segment, as in the unsplit row. Segments starting in the slice need only its own keys and values (plainly
causal, batched by length as in gspo.core.attention). The one segment per row continuing from an earlier
slice also sees that segment's earlier keys (lower-right causal): `_GatheredAttention` all-gathers every
slice's keys and values (the caller's ``SequenceSplit.gather``) and keeps only this rank's own for the
backward, which gathers them again. RoPE needs nothing more: each slice passes its own position_ids.
The rank scores the tokens its hidden states predict (columns lo+1..hi of its slice [lo, hi)), through
the chunked LM head; the loss all-reduces each sequence's sums over the group (gspo.core.objectives'
``segment_sum_reduce``). Only packed rows (position_ids restarting at 0 per sequence) are supported.
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
    """Segments starting in the slice, in one causal sdpa call: S pieces padded to L tokens."""

    tokens: Tensor  # (S * L,) local flat index b * P + (t - lo) of each slot (padding repeats one)
    keep: Tensor  # (n,) the slots holding real tokens
    shape: tuple[int, int]  # (S, L)


@dataclass(frozen=True)
class _Continuing:
    """A segment continuing from an earlier slice: the slice's queries [lo, qe) of one row against the
    gathered keys [cs, qe), the first lo - cs of them (``offset``) from earlier slices."""

    queries: Tensor  # (Lq,) local flat index b * P + (t - lo)
    row: int  # b
    keys: slice  # columns cs .. qe
    offset: int


@dataclass(frozen=True)
class SliceLayout:
    """The pieces of a slice [lo, hi) of packed rows of width T, and where the local tokens land."""

    continuing: list[_Continuing]
    starting: list[_Pieces]
    inverse: Tensor  # (B * P,) position of local token b * P + p among the continuing queries, then the
    # starting pieces' kept slots
    split: SequenceSplit

    @functools.cached_property
    def continuing_queries(self) -> Tensor:
        """(n,) the continuing pieces' queries, in order."""
        return torch.cat([piece.queries for piece in self.continuing] or [self.inverse[:0]])


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
    continuing_pieces, starting_pieces, chosen = [], [], []
    for b, cs, qe in continuing:
        queries = b * part + torch.arange(qe - lo)
        continuing_pieces.append(_Continuing(queries.to(device), b, slice(cs, qe), lo - cs))
        chosen.append(queries)
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
        tokens, valid = (row * part + column - lo).reshape(-1), (slot < length).reshape(-1)
        keep = valid.nonzero().squeeze(1)
        starting_pieces.append(_Pieces(tokens.to(device), keep.to(device), (j - i, longest)))
        chosen.append(tokens[keep])
        i = j
    inverse = torch.argsort(torch.cat(chosen)).to(device)
    return SliceLayout(continuing_pieces, starting_pieces, inverse, split)


QUERY_BLOCK = 32
"""Queries per sdpa call where a piece needs a mask: each block's (QUERY_BLOCK, keys) mask lives only
during its call, recomputed in the backward (activation checkpointing), so no (Lq, Lk) mask is ever held.
Small, because the CPU kernel's buffers for a masked call grow with QUERY_BLOCK x keys."""


LOWER_RIGHT_DEVICES = ("cuda",)
"""Where sdpa runs a lower-right causal CausalBias without materialising its mask (flash attention)."""


@dataclass(frozen=True)
class _Attend:
    """What every sdpa call of one layer shares."""

    scale: float | None
    gqa: bool
    window: int | None  # transformers' sliding window: keys fewer than `window` columns back

    def merges_log_sum_exps(self, device: torch.device) -> bool:
        """Whether a continuing piece runs as `_prefix_then_causal` (CPU flash attention, no window)."""
        return device.type == "cpu" and self.window is None


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
        q, k, v, attn_mask=visible, scale=how.scale, enable_gqa=how.gqa
    )


def _expand_heads(x: Tensor, heads: int) -> Tensor:
    """(S, Hkv, L, D) -> (S, H, L, D): each key/value head repeated for its query heads (the CPU flash
    kernel wants as many of them as query heads)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _key_blocks(offset: int, queries: int, block: int) -> list[tuple[int, int, bool]]:
    """(first key, last key + 1, causal) of `_prefix_then_causal`'s kernel calls: the prefix's ``offset``
    keys in blocks of at most ``block``, then the queries' own."""
    prefix = [(start, min(start + block, offset), False) for start in range(0, offset, block)]
    return [*prefix, (offset, offset + queries, True)]


def _prefix_then_causal(
    q: Tensor, k: Tensor, v: Tensor, offset: int, scale: float | None, block: int
) -> tuple[Tensor, Tensor]:
    """CPU flash attention of queries (S, H, Lq, D) against keys (S, Hkv, offset + Lq, D), the first
    ``offset`` all visible (a prefix), the rest causal (the queries' own): kernel calls on blocks of at most
    ``block`` keys merged by their log-sum-exps, no mask, so no copy of the keys per query head is longer
    than a block. Returns the output (S, H, Lq, Dv) and its log-sum-exp (S, H, Lq)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = None, None
    for first, last, causal in _key_blocks(offset, q.shape[2], block):
        k_block, v_block = (_expand_heads(x[:, :, first:last], q.shape[1]) for x in (k, v))
        out_block, lse_block = flash(q, k_block, v_block, 0.0, causal, scale=scale)
        if out is None:
            out, lse = out_block.float(), lse_block
            continue
        # out = sum_blocks exp(lse_block - lse) out_block
        merged = torch.logaddexp(lse, lse_block)  # (S, H, Lq)
        out = out * (lse - merged).exp().unsqueeze(-1) + out_block * (lse_block - merged).exp().unsqueeze(-1)
        lse = merged
    return out.to(q.dtype), lse


def _prefix_then_causal_backward(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    offset: int,
    scale: float | None,
    block: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of `_prefix_then_causal`'s output for q, k, v: the kernel's own backward on each block
    with the merged output and log-sum-exp, as ring attention does (each key block's gradient needs only
    those); the repeated heads' key and value gradients summed back to their group's head."""
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    grad = grad.contiguous()
    dq, dk, dv = torch.zeros_like(q), torch.empty_like(k), torch.empty_like(v)
    for first, last, causal in _key_blocks(offset, q.shape[2], block):
        k_block, v_block = (_expand_heads(x[:, :, first:last], q.shape[1]) for x in (k, v))
        dq_block, dk_block, dv_block = backward(grad, q, k_block, v_block, out, lse, 0.0, causal, scale=scale)
        dq += dq_block
        dk[:, :, first:last] = dk_block.unflatten(1, (k.shape[1], -1)).sum(2)
        dv[:, :, first:last] = dv_block.unflatten(1, (v.shape[1], -1)).sum(2)
    return dq, dk, dv


def _attend(q: Tensor, k: Tensor, v: Tensor, offset: int, how: _Attend) -> Tensor:
    """(S, H, Lq, Dv): query i sees key j where j <= i + offset (and within the window). Plainly causal:
    sdpa's is_causal. A lower-right causal piece (the keys before the queries, then the queries' own) on
    CUDA: torch's CausalBias, which flash attention runs without a mask. Otherwise (a sliding window; on
    CPU without one, `_prefix_then_causal` takes continuing pieces) masked blocks of queries, checkpointed
    (QUERY_BLOCK)."""
    lq, lk = q.shape[2], k.shape[2]
    sdpa = functools.partial(
        torch.nn.functional.scaled_dot_product_attention, scale=how.scale, enable_gqa=how.gqa
    )
    if how.window is None and offset == 0:
        return sdpa(q, k, v, is_causal=True)
    if how.window is None and offset == lk - lq and q.device.type in LOWER_RIGHT_DEVICES:
        return sdpa(q, k, v, attn_mask=causal_lower_right(lq, lk))
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


def _piece(x: Tensor, piece: _Continuing) -> Tensor:
    """The keys (or values, or their gradients) of a continuing piece in ``x`` (B, Hkv, T, D): a view
    (1, Hkv, Lk, D)."""
    return x[piece.row : piece.row + 1, :, piece.keys]


class _GatheredAttention(torch.autograd.Function):
    """One layer's continuing pieces: their queries (n, H, D), in order, against the keys and values
    all-gathered from every slice's ``kv`` (B, Hkv, P, D + Dv) -> (n, H, Dv).

    The gathered (B, Hkv, T, .) tensor lives only during the forward: the backward gathers it again (one
    more all-gather per layer) and reduce-scatters its gradient through the gather's own backward. So the
    backward keeps only this rank's queries and ``kv``, and per piece on CPU (`_prefix_then_causal`, key
    blocks one slice wide) its output and log-sum-exp; elsewhere it recomputes the piece's attention.
    Every rank of the group calls it in every layer, the first one with no piece, so the collectives pair
    up (autograd runs the backward of an output with no rows too)."""

    @staticmethod
    def forward(ctx, q: Tensor, kv: Tensor, layout: SliceLayout, how: _Attend, key_dim: int) -> Tensor:
        ctx.layout, ctx.how, ctx.key_dim = layout, how, key_dim
        ctx.sizes = [len(piece.queries) for piece in layout.continuing]
        keys, values = layout.split.gather(kv).split([key_dim, kv.shape[-1] - key_dim], dim=-1)
        outputs, stats = [q.new_empty(0, q.shape[1], values.shape[-1])], []
        for piece, query in zip(layout.continuing, q.split(ctx.sizes), strict=True):
            args = (query.unsqueeze(0).transpose(1, 2), _piece(keys, piece), _piece(values, piece))
            if how.merges_log_sum_exps(q.device):
                out, lse = _prefix_then_causal(*args, piece.offset, how.scale, block=kv.shape[2])
                stats += [out, lse]
            else:
                out = _attend(*args, piece.offset, how)
            outputs.append(out.squeeze(0).transpose(0, 1))
        ctx.save_for_backward(q, kv, *stats)
        return torch.cat(outputs)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, kv, *saved = ctx.saved_tensors
        stats = iter(saved)
        own = kv.detach().requires_grad_()
        with torch.enable_grad():
            gathered = ctx.layout.split.gather(own)  # the forward's keys and values, gathered again
        d_gathered = torch.zeros_like(gathered)
        dims = [ctx.key_dim, kv.shape[-1] - ctx.key_dim]
        (keys, values), (d_keys, d_values) = (x.split(dims, dim=-1) for x in (gathered.detach(), d_gathered))
        d_queries = [torch.zeros_like(q[:0])]
        pieces = zip(ctx.layout.continuing, q.split(ctx.sizes), grad.split(ctx.sizes), strict=True)
        for piece, query, upstream in pieces:
            args = (query.unsqueeze(0).transpose(1, 2), _piece(keys, piece), _piece(values, piece))
            upstream = upstream.unsqueeze(0).transpose(1, 2)
            if ctx.how.merges_log_sum_exps(q.device):
                out, lse = next(stats), next(stats)
                dq, dk, dv = _prefix_then_causal_backward(
                    upstream, *args, out, lse, piece.offset, ctx.how.scale, block=kv.shape[2]
                )
            else:
                with torch.enable_grad():
                    leaves = [x.detach().requires_grad_() for x in args]
                    out = _attend(*leaves, piece.offset, ctx.how)
                    dq, dk, dv = torch.autograd.grad(out, leaves, upstream)
            d_queries.append(dq.squeeze(0).transpose(0, 1))
            _piece(d_keys, piece).add_(dk)
            _piece(d_values, piece).add_(dv)
        # the gather's backward: each slice's gradient summed over the ranks (a reduce-scatter)
        (d_own,) = torch.autograd.grad(gathered, own, d_gathered)
        return torch.cat(d_queries), d_own, None, None, None


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
        raise RuntimeError(f"the {NAME!r} attention runs only inside gspo.core.row_slices.split_attention")
    if kwargs.get("softcap") is not None:
        raise NotImplementedError(f"{NAME!r}: attention soft-capping is not supported")
    if dropout:
        raise NotImplementedError(
            f"{NAME!r}: attention dropout ({dropout}) is not supported: set the model's attention_dropout=0, "
            "or distributed.sequence_parallel=1"
        )
    batch, heads, part, _ = query.shape
    kv_heads, key_dim, value_dim = key.shape[1], key.shape[-1], value.shape[-1]
    kv = torch.cat([key, value], dim=-1)  # (B, Hkv, P, D + Dv): one collective gathers both
    q = query.transpose(1, 2).reshape(batch * part, heads, -1)
    local = kv.transpose(1, 2).reshape(batch * part, kv_heads, -1)
    how = _Attend(scaling, kv_heads != heads, kwargs.get("sliding_window"))
    continuing = q.index_select(0, layout.continuing_queries)
    outputs = [_GatheredAttention.apply(continuing, kv, layout, how, key_dim)]
    for pieces in layout.starting:  # their keys are the slice's own
        count, length = pieces.shape
        k, v = (
            local.index_select(0, pieces.tokens)
            .view(count, length, kv_heads, -1)
            .transpose(1, 2)
            .split([key_dim, value_dim], dim=-1)
        )
        query_slots = q.index_select(0, pieces.tokens).view(count, length, heads, -1).transpose(1, 2)
        out = _attend(query_slots, k, v, 0, how)  # (S, H, L, Dv)
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
