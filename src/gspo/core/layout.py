"""Sequences laid out as model inputs: shared-prefix rows, packed rows, or one padded row each.

"packed": a row concatenates prompt+completion sequences, ``position_ids`` restarting at 0 for each, so
attention keeps them apart. "shared_prefix": sequences with the same prompt (a group's G samples) form a
tree, the prompt once and then each completion, its positions continuing from the prompt's length and
``branch_ids`` telling the attention (gspo.core.attention) that a completion sees the prompt and itself
only. Rows are at most ``pack_length`` tokens (first-fit decreasing); micro-batches hold rows up to a
token budget, so a minibatch of any size fits in memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

LAYOUTS = ("shared_prefix", "packed", "padded")


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
    tokens, -1 elsewhere; indices: which sequences of the caller's list this micro-batch holds;
    branch_ids: (R, L) long in shared-prefix rows, 0 on a tree's prompt (and padding), b on the tokens of
    its b-th completion (b >= 1); None in the other layouts.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    logprob_mask: torch.Tensor
    segment_ids: torch.Tensor
    indices: list[int]
    branch_ids: torch.Tensor | None = None

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


def _items(sequences: list[Sequence], layout: str, pack_length: int) -> list[list[int]]:
    """What is laid out whole: one sequence, or (shared_prefix) the sequences sharing a prompt, as many
    as fit ``pack_length`` together (the prompt once), at least one."""
    if layout != "shared_prefix":
        return [[i] for i in range(len(sequences))]
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i, seq in enumerate(sequences):
        by_prompt.setdefault(tuple(seq.prompt_ids), []).append(i)
    items = []
    for prompt, members in by_prompt.items():
        tree, size = [], len(prompt)
        for i in members:
            n = len(sequences[i].completion_ids)
            if tree and size + n > pack_length:
                items.append(tree)
                tree, size = [], len(prompt)
            tree.append(i)
            size += n
        items.append(tree)
    return items


def _first_fit_rows(lengths: list[int], pack_length: int) -> list[list[int]]:
    """Items into rows of at most pack_length tokens, first-fit decreasing; returns item indices per row."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:  # an item longer than pack_length gets a row of its own
            rows.append([i])
            room.append(pack_length - lengths[i])
    return rows


def _build(sequences: list[Sequence], rows: list[list[list[int]]], pad_id: int, layout: str) -> MicroBatch:
    """One micro-batch from rows of items (lists of sequence indices; more than one only when sharing)."""
    shared = layout == "shared_prefix"

    def item_length(item: list[int]) -> int:
        if not shared:
            return sum(len(sequences[i]) for i in item)
        return len(sequences[item[0]].prompt_ids) + sum(len(sequences[i].completion_ids) for i in item)

    width = max(sum(item_length(item) for item in row) for row in rows)
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    branch_ids = torch.zeros(shape, dtype=torch.long)
    logprob_mask = torch.zeros(shape, dtype=torch.bool)
    segment_ids = torch.full(shape, -1, dtype=torch.long)
    indices: list[int] = []
    for r, row in enumerate(rows):
        start = 0
        for item in row:
            prompt = sequences[item[0]].prompt_ids
            p = len(prompt)
            for b, i in enumerate(item, 1):
                seq = sequences[i]
                if b == 1 or not shared:  # the prompt, once per tree when shared
                    input_ids[r, start : start + p] = torch.tensor(seq.prompt_ids, dtype=torch.long)
                    position_ids[r, start : start + p] = torch.arange(p)
                    attention_mask[r, start : start + p] = 1
                    start += p
                n = len(seq.completion_ids)
                # a completion continues its prompt's positions, whether it follows it or a sibling
                input_ids[r, start : start + n] = torch.tensor(seq.completion_ids, dtype=torch.long)
                position_ids[r, start : start + n] = torch.arange(p, p + n)
                attention_mask[r, start : start + n] = 1
                branch_ids[r, start : start + n] = b
                logprob_mask[r, start : start + n] = True
                train = torch.tensor(seq.train_mask, dtype=torch.bool)
                segment_ids[r, start : start + n] = torch.where(train, len(indices), -1)
                indices.append(i)
                start += n
        # tail padding: positions restart so it is a separate block nobody attends to
        position_ids[r, start:] = torch.arange(width - start)
    return MicroBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask if layout == "padded" else None,
        logprob_mask=logprob_mask,
        segment_ids=segment_ids.reshape(-1),
        indices=indices,
        branch_ids=branch_ids if shared else None,
    )


def make_micro_batches(
    sequences: list[Sequence], *, layout: str, pack_length: int, micro_batch_tokens: int, pad_id: int
) -> list[MicroBatch]:
    """Split `sequences` into micro-batches of at most `micro_batch_tokens` tokens (padding included).

    layout: "shared_prefix" (sequences with one prompt share it, rows up to `pack_length` tokens),
    "packed" (rows of several sequences up to `pack_length` tokens) or "padded" (one right-padded
    sequence a row).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    items = _items(sequences, layout, pack_length)
    lengths = [
        len(sequences[item[0]].prompt_ids) + sum(len(sequences[i].completion_ids) for i in item)
        if layout == "shared_prefix"
        else len(sequences[item[0]])
        for item in items
    ]
    if layout == "padded":
        item_rows = [[k] for k in sorted(range(len(items)), key=lambda k: -lengths[k])]
    else:
        item_rows = _first_fit_rows(lengths, pack_length)
    batches: list[MicroBatch] = []
    current: list[list[int]] = []
    for row in item_rows:  # rows come longest first, so a micro-batch's width is its first row's length
        candidate = [*current, row]
        width = max(sum(lengths[k] for k in r) for r in candidate)
        if current and width * len(candidate) > micro_batch_tokens:
            batches.append(_build(sequences, [[items[k] for k in r] for r in current], pad_id, layout))
            candidate = [row]
        current = candidate
    if current:
        batches.append(_build(sequences, [[items[k] for k in r] for r in current], pad_id, layout))
    return batches


def layout_is_exact(
    score: Callable[[MicroBatch], torch.Tensor], vocab_size: int, pad_id: int, layout: str = "packed"
) -> bool:
    """Probe whether a model computes ``layout`` exactly: the log-probs of three short sequences (two of
    them sharing a prompt) must equal those of the padded layout. `score(mb)` returns (R*L,) log-probs."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, vocab_size, (18,), generator=generator).tolist()
    sequences = [
        Sequence(tokens[:3], tokens[3:8], [True] * 5),
        Sequence(tokens[8:10], tokens[10:14], [True] * 4),
        Sequence(tokens[:3], tokens[14:], [True] * 4),  # the first one's prompt
    ]
    values = []
    for candidate in (layout, "padded"):
        (mb,) = make_micro_batches(
            sequences, layout=candidate, pack_length=64, micro_batch_tokens=1024, pad_id=pad_id
        )
        flat = score(mb)
        # completion-token log-probs in sequence order (the layouts order sequences their own way)
        per_sequence = {i: flat[mb.segment_ids == k] for k, i in enumerate(mb.indices)}
        values.append(torch.cat([per_sequence[i] for i in range(len(sequences))]))
    return bool(torch.allclose(values[0], values[1], rtol=1e-4, atol=1e-4))
