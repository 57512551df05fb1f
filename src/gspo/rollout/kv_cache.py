"""A preallocated key/value cache of sequence slots, written in place, and the attention that reads it.

`SlotCache` holds each layer's keys and values as one (slots, kv_heads, capacity, head_dim) tensor. Slot
s keeps its sequence at indices 0 .. length_s - 1, so a token's cache index is its position. A forward
through the model's own modules (inside `slot_attention`) writes the new tokens' keys and values at each
row's own offset (`Plan.starts`) and attends over the first `Plan.width` indices of the rows with the
mask of each row's length: causal, and inside the layer's sliding window where it has one. Nothing is
concatenated, nothing is copied per step beyond the new tokens.

Grouped-query attention needs no copy either: a decode step's H query heads of a row are laid out as
(kv_heads, H / kv_heads) "query positions" of its kv_heads heads (transformers' repeat_kv pairs query head
h with kv head h // (H / kv_heads), the same pairing).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.cache_utils import Cache

NAME = "gspo_slots"
"""The attention implementation registered with transformers, active only inside `slot_attention`."""


@dataclass(eq=False)
class Plan:
    """Where one forward's new tokens go: rows 0 .. n-1 of the cache, row r's q new tokens at cache
    indices starts[r] .. starts[r] + q - 1 (`make_plan`: the real ones and the padding). Attention reads
    cache indices 0 .. width - 1 with `masks[window]`."""

    starts: Tensor  # (n,) long
    width: int
    masks: dict[int | None, Tensor]  # per sliding window (None: none), (n, 1, q, width) additive float
    calls: int = 0  # attention calls that read it (0 after a forward: the model bypassed it)
    first: int = (
        0  # a prefill's (q > 1) start, the same for every row: the cache indices before it are filled
    )


def make_plan(
    starts: Tensor, lengths: Tensor, queries: int, width: int, windows: set[int | None], dtype: torch.dtype
) -> Plan:
    """The plan of q = `queries` new tokens per row, of which row r has lengths[r] real ones (width:
    the largest starts + lengths, known on the host), with a mask for each sliding window in `windows`:
    query i of row r (at index starts[r] + i) sees key k when k <= starts[r] + i, k < starts[r] +
    lengths[r], and, with a window, k > starts[r] + i - window (transformers' sliding_window_overlay).
    A padding query sees the row's real keys. Masks are additive (0 or -inf, in `dtype`): sdpa would
    convert a boolean one in every layer."""
    key = torch.arange(width, device=starts.device)
    query = (starts[:, None] + torch.arange(queries, device=starts.device))[:, :, None]  # (n, q, 1)
    seen = (key <= query) & (key < (starts + lengths)[:, None, None])
    masks = {}
    for window in windows:
        inside = seen if window is None else seen & (key > query - window)
        mask = torch.zeros(inside.shape, dtype=dtype, device=starts.device)
        masks[window] = mask.masked_fill_(~inside, float("-inf"))[:, None]
    return Plan(starts, width, masks)


class SlotCache(Cache):
    """Keys and values of `slots` sequences of up to `capacity` tokens each, allocated at a layer's first
    write (its kv_heads, head_dim and dtype are those of the model's keys)."""

    def __init__(self, num_layers: int, slots: int, capacity: int) -> None:
        super().__init__(layers=[])
        self.num_layers, self.slots, self.capacity = num_layers, slots, capacity
        self.plan: Plan | None = None
        """Where the current forward writes (set by the engine before each forward)."""
        self.keys: list[Tensor | None] = [None] * num_layers
        self.values: list[Tensor | None] = [None] * num_layers

    def __len__(self) -> int:
        return self.num_layers

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise NotImplementedError("SlotCache rows have lengths of their own: pass position_ids")

    def allocate(self, layer: int, like_key: Tensor, like_value: Tensor) -> None:
        """Room for layer `layer`, shaped after one row's (kv_heads, tokens, head_dim) keys and values.
        Zeros, not empty memory: attention reads the masked indices too, and NaN there (0 x NaN) would
        poison the row."""
        shape = (self.slots, like_key.shape[-3], self.capacity)
        self.keys[layer] = like_key.new_zeros((*shape, like_key.shape[-1]))
        self.values[layer] = like_value.new_zeros((*shape, like_value.shape[-1]))

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        """Write the (n, kv_heads, q, d) new keys and values at the plan's offsets; return the (n,
        kv_heads, width, d) views the attention reads."""
        plan = self.plan
        if self.keys[layer_idx] is None or self.keys[layer_idx].dtype != key_states.dtype:
            self.allocate(layer_idx, key_states[0], value_states[0])
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        rows, queries = key_states.shape[0], key_states.shape[2]
        if queries == 1:  # a decode step: one token per row, each at its own offset
            index = torch.arange(rows, device=keys.device)
            keys[index, :, plan.starts] = key_states[:, :, 0]
            values[index, :, plan.starts] = value_states[:, :, 0]
        else:  # a prefill: every row starts at plan.first
            keys[:rows, :, plan.first : plan.first + queries] = key_states
            values[:rows, :, plan.first : plan.first + queries] = value_states
        return keys[:rows, :, : plan.width], values[:rows, :, : plan.width]

    def copy_rows(self, source: SlotCache, rows: Tensor, to: Tensor, length: int) -> None:
        """Slots `to` (m,) take the first `length` cache indices of `source`'s rows `rows` (m,)."""
        for layer in range(self.num_layers):
            key, value = source.keys[layer], source.values[layer]
            if self.keys[layer] is None or self.keys[layer].dtype != key.dtype:
                self.allocate(layer, key[0], value[0])
            self.keys[layer][to, :, :length] = key[rows, :, :length]
            self.values[layer][to, :, :length] = value[rows, :, :length]

    def move(self, source: int, to: int, length: int) -> None:
        """Slot `to` takes slot `source`'s first `length` cache indices (compaction)."""
        for keys, values in zip(self.keys, self.values, strict=True):
            if keys is not None:
                keys[to, :, :length] = keys[source, :, :length]
                values[to, :, :length] = values[source, :, :length]

    def grow(self, capacity: int) -> None:
        """Room for `capacity` tokens per slot, the cached ones kept."""

        def grown(cached: Tensor) -> Tensor:
            rows, heads, _, dim = cached.shape
            return torch.cat([cached, cached.new_zeros((rows, heads, capacity - self.capacity, dim))], 2)

        self.keys = [None if k is None else grown(k) for k in self.keys]
        self.values = [None if v is None else grown(v) for v in self.values]
        self.capacity = capacity


def _slot_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers attention function: (n, H, q, d) queries, (n, Hkv, width, d) keys and values of the
    cache -> (n, q, H, d)."""
    plan = kwargs.get("gspo_plan")
    if plan is None:
        raise RuntimeError(f"the {NAME!r} attention needs the forward's gspo_plan= (gspo.rollout.hf_engine)")
    for unsupported in ("softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"the sampling engine's attention does not support {unsupported}")
    plan.calls += 1
    rows, heads, queries, _ = query.shape
    kv_heads = key.shape[1]
    mask = plan.masks.get(sliding_window)
    if mask is None:
        raise RuntimeError(
            f"the engine built no mask for sliding_window={sliding_window} (config.sliding_window?)"
        )
    if mask.dtype != query.dtype:
        mask = mask.to(query.dtype)
    if queries == 1:  # the query heads of a kv head as its query positions: one mask row serves them all
        grouped = query.view(rows, kv_heads, heads // kv_heads, query.shape[-1])
        out = torch.nn.functional.scaled_dot_product_attention(
            grouped, key, value, attn_mask=mask, scale=scaling
        )
        return out.view(rows, heads, 1, value.shape[-1]).transpose(1, 2), None
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=kv_heads != heads
    )
    return out.transpose(1, 2), None


AttentionInterface.register(NAME, _slot_attention_forward)


def cache_kwarg(decoder: torch.nn.Module) -> str:
    """The name under which `decoder`'s forward takes a cache: "cache" from transformers 5.24 on (where
    "past_key_values" is deprecated, and gone from 5.40), "past_key_values" before."""
    return "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"


@contextlib.contextmanager
def slot_attention(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, `model`'s attention is the slot cache's: its forwards take
    a SlotCache (`cache_kwarg`) whose `plan` is set and `gspo_plan=` the same plan. `model`: a
    transformers model whose config the block switches and restores (no other forward of the same
    model may run meanwhile)."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = NAME  # transformers builds no mask for unknown names: the plan has it
    try:
        yield
    finally:
        config._attn_implementation = previous
