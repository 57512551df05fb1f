"""Sequences laid out as model inputs: packed rows (no padding inside a row) or one padded row each.

A packed row concatenates several prompt+completion sequences, its ``position_ids`` restarting at 0 for
each, so attention keeps them apart; rows are at most ``pack_length`` tokens (first-fit decreasing) and
micro-batches hold rows up to a token budget, so a minibatch of any size fits in memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Sequence:
    """One prompt+completion to score; `train_mask[k]` says whether completion token k gets gradient."""

    prompt_ids: list[int]
    completion_ids: list[int]
    train_mask: list[bool]

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass
class MicroBatch:
    """Model inputs for a group of rows, and where each sequence's completion tokens landed.

    input_ids, position_ids: (R, L); attention_mask: (R, L) or None (packed rows);
    logprob_mask: (R, L) bool, True on every completion token;
    segment_ids: (R*L,) long, the index of the sequence (in `indices` order) on trained completion
    tokens, -1 elsewhere; indices: which sequences of the caller's list this micro-batch holds.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    logprob_mask: torch.Tensor
    segment_ids: torch.Tensor
    indices: list[int]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def to(self, device: torch.device) -> MicroBatch:
        """The same micro-batch with its tensors on ``device`` (itself when they already are)."""
        if self.input_ids.device == device:
            return self
        moved = {
            f.name: getattr(self, f.name).to(device, non_blocking=True)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)


def _first_fit_rows(lengths: list[int], pack_length: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:  # a sequence longer than pack_length gets a row of its own
            rows.append([i])
            room.append(pack_length - lengths[i])
    return rows


def _build(sequences: list[Sequence], rows: list[list[int]], pad_id: int, packed: bool) -> MicroBatch:
    width = max(sum(len(sequences[i]) for i in row) for row in rows)
    n_rows = len(rows)
    input_ids = torch.full((n_rows, width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((n_rows, width), dtype=torch.long)
    attention_mask = torch.zeros((n_rows, width), dtype=torch.long)
    logprob_mask = torch.zeros((n_rows, width), dtype=torch.bool)
    segment_ids = torch.full((n_rows, width), -1, dtype=torch.long)
    indices: list[int] = []
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            seq = sequences[i]
            n, p = len(seq), len(seq.prompt_ids)
            input_ids[r, start : start + n] = torch.tensor(seq.prompt_ids + seq.completion_ids)
            position_ids[r, start : start + n] = torch.arange(n)
            attention_mask[r, start : start + n] = 1
            logprob_mask[r, start + p : start + n] = True
            train = torch.tensor(seq.train_mask, dtype=torch.bool)
            segment_ids[r, start + p : start + n] = torch.where(train, len(indices), -1)
            indices.append(i)
            start += n
        # tail padding: positions restart so it is a separate block nobody attends to
        position_ids[r, start:] = torch.arange(width - start)
    return MicroBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=None if packed else attention_mask,
        logprob_mask=logprob_mask,
        segment_ids=segment_ids.reshape(-1),
        indices=indices,
    )


def make_micro_batches(
    sequences: list[Sequence], *, packed: bool, pack_length: int, micro_batch_tokens: int, pad_id: int
) -> list[MicroBatch]:
    """Split `sequences` into micro-batches of at most `micro_batch_tokens` tokens (padding included).

    Packed: rows of several sequences up to `pack_length` tokens. Not packed: one right-padded sequence a row.
    """
    lengths = [len(s) for s in sequences]
    rows = (
        _first_fit_rows(lengths, pack_length)
        if packed
        else [[i] for i in sorted(range(len(lengths)), key=lambda i: -lengths[i])]
    )
    batches: list[MicroBatch] = []
    current: list[list[int]] = []
    for row in rows:  # rows come longest first, so a micro-batch's width is its first row's length
        candidate = [*current, row]
        width = max(sum(lengths[i] for i in r) for r in candidate)
        if current and width * len(candidate) > micro_batch_tokens:
            batches.append(_build(sequences, current, pad_id, packed))
            candidate = [row]
        current = candidate
    if current:
        batches.append(_build(sequences, current, pad_id, packed))
    return batches


def packing_is_exact(score: Callable[[MicroBatch], torch.Tensor], vocab_size: int, pad_id: int) -> bool:
    """Probe whether a model keeps packed sequences apart: the log-probs of two short sequences must be
    the same packed into one row as padded into two. `score(mb)` returns (R*L,) flattened log-probs."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, vocab_size, (14,), generator=generator).tolist()
    sequences = [
        Sequence(tokens[:3], tokens[3:8], [True] * 5),
        Sequence(tokens[8:10], tokens[10:], [True] * 4),
    ]
    values = []
    for packed in (True, False):
        (mb,) = make_micro_batches(
            sequences, packed=packed, pack_length=64, micro_batch_tokens=1024, pad_id=pad_id
        )
        flat = score(mb)
        # completion-token log-probs in sequence order (make_micro_batches orders by length, so sort back)
        per_sequence = {}
        for k, i in enumerate(mb.indices):
            per_sequence[i] = flat[mb.segment_ids == k]
        values.append(torch.cat([per_sequence[i] for i in range(len(sequences))]))
    return bool(torch.allclose(values[0], values[1], rtol=1e-4, atol=1e-4))
