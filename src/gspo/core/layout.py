"""Sequences laid out as model inputs: prefix-tree rows, packed rows, or one padded row each.

"packed": a row concatenates prompt+completion sequences, ``position_ids`` restarting at 0 for each, so
attention keeps them apart. "shared_prefix": a row holds prefix trees of its sequences' prompts, every
prompt token computed once for all the sequences of its tree that share it (a group's G samples share their
whole prompt; prompts with a common system message share that where it saves more than the larger tree's
attention costs: MERGE_WIDTH), and each completion a branch of its own. The
tokens are in depth-first order with ``position_ids`` their depth, so a token's ancestors (the earlier
tokens of its own sequence, all it attends to: gspo.core.attention) are the earlier tokens of its tree
whose subtree it is in. Rows are at most ``pack_length`` tokens; micro-batches hold rows up to a token
budget, so a minibatch of any size fits in memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

LAYOUTS = ("shared_prefix", "packed", "padded")


@dataclass
class TokenSequence:
    """One prompt+completion to score; `train_mask[k]` says whether completion token k gets gradient."""

    prompt_ids: list[int]
    completion_ids: list[int]
    train_mask: list[bool]

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass(frozen=True)
class SequenceSplit:
    """This rank's slice of a micro-batch's rows under sequence data parallelism: the rows' columns are
    cut into ``size`` contiguous slices of equal width and this rank computes slice ``index`` (gspo.core.
    sequence_parallel). ``gather``: (B, h, T / size, D) -> (B, h, T, D), every rank's slice concatenated
    along dim 2 in slice order, differentiable (the caller's all-gather over the group)."""

    index: int
    size: int
    gather: Callable[[Tensor], Tensor]

    def bounds(self, width: int) -> tuple[int, int]:
        """The columns [lo, hi) of rows ``width`` wide whose hidden states this rank computes."""
        if width % self.size:
            raise ValueError(f"rows of {width} columns do not split into {self.size} equal slices")
        part = width // self.size
        return self.index * part, (self.index + 1) * part


@dataclass
class MicroBatch:
    """Model inputs for a group of rows, and where each sequence's completion tokens landed.

    input_ids, position_ids: (R, L); attention_mask: (R, L) or None (packed rows);
    logprob_mask: (R, L) bool, True on every completion token;
    segment_ids: (R*L,) long, the index of the sequence (in `indices` order) on trained completion
    tokens, -1 elsewhere; indices: which sequences of the caller's list this micro-batch holds;
    prefix_tree: the rows are prefix trees in depth-first order, position_ids the depth (shared_prefix);
    split: the slice of the rows this rank computes (sequence data parallelism), None: whole rows.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    logprob_mask: torch.Tensor
    segment_ids: torch.Tensor
    indices: list[int]
    prefix_tree: bool = False
    split: SequenceSplit | None = None

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


def _common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


Piece = tuple[list[int], int, int | None]
"""Tokens laid out in a row: (token ids, the first one's position, the sequence whose completion they are,
or None for prompt tokens)."""


MERGE_WIDTH = 1536
"""Prompts of different groups share their common start in one tree when it saves more than it costs. A
tree's attention mask is dense, so a tree of T tokens that grows by n computes about 2 T n more attention
scores (8 d T n FLOPs a layer, d the hidden size), while s shared tokens save about 24 d^2 s (a Llama-like
layer's matmuls): sharing pays when s >= T n / (3 d). 3 d = 1536 for d = 512; larger models share more
readily than this rule lets them. A group's own samples always share their whole prompt."""


def _pieces(sequences: list[TokenSequence], row: list[int], tree: bool) -> list[Piece]:
    """A row's tokens in order: each sequence's prompt then completion; in prefix trees (``row`` sorted by
    prompt) a prompt only from where it leaves the previous sequence's, its completion a new branch, and a
    new tree instead where a prompt of another group shares too little with it (MERGE_WIDTH)."""
    out: list[Piece] = []
    previous: list[int] | None = None
    tree_tokens = 0
    for i in row:
        seq = sequences[i]
        shared = 0
        if tree and previous is not None:
            shared = _common_prefix(previous, seq.prompt_ids)
            same_prompt = shared == len(previous) == len(seq.prompt_ids)
            if not same_prompt and shared * MERGE_WIDTH < tree_tokens * (len(seq) - shared):
                shared, tree_tokens = 0, 0  # a tree of its own
        out.append((seq.prompt_ids[shared:], shared, None))
        out.append((seq.completion_ids, len(seq.prompt_ids), i))
        tree_tokens += len(seq) - shared
        previous = seq.prompt_ids
    return out


def _row_length(sequences: list[TokenSequence], row: list[int], tree: bool) -> int:
    return sum(len(tokens) for tokens, _, _ in _pieces(sequences, row, tree))


def _by_prompt(sequences: list[TokenSequence], row: list[int]) -> list[int]:
    return sorted(row, key=lambda i: sequences[i].prompt_ids)


def _tree_rows(sequences: list[TokenSequence], pack_length: int) -> list[list[int]]:
    """Sequences in prefix-tree rows of at most ``pack_length`` tokens (a longer group's samples split
    into trees of their own). A prompt's samples go together (as many as fit), largest first, each into the
    first row where the row's trees, laid out with them, still fit; what they add is at least their tokens
    less the longest prefix of their prompt that the row already holds (a trie grows by a string's length
    less its longest prefix already in it), which rules out most rows cheaply. A row's sequences are sorted
    by prompt, the order in which each shares with its neighbour all it can share."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i, seq in enumerate(sequences):
        by_prompt.setdefault(tuple(seq.prompt_ids), []).append(i)
    items: list[tuple[list[int], int]] = []  # (sequences, tokens) of one prompt
    for prompt, members in by_prompt.items():
        tree, size = [], len(prompt)
        for i in members:
            n = len(sequences[i].completion_ids)
            if tree and size + n > pack_length:  # the rest of the group in another tree
                items.append((tree, size))
                tree, size = [], len(prompt)
            tree.append(i)
            size += n
        items.append((tree, size))
    rows: list[list[int]] = []
    prompts: list[list[list[int]]] = []  # each row's prompts, one per item placed in it
    room: list[int] = []
    for members, size in sorted(items, key=lambda item: -item[1]):
        prompt = sequences[members[0]].prompt_ids
        for r, row in enumerate(rows):
            if size - len(prompt) > room[r]:  # not even its completions fit
                continue
            if size - max(_common_prefix(other, prompt) for other in prompts[r]) > room[r]:
                continue
            length = _row_length(sequences, _by_prompt(sequences, row + members), True)
            if length <= pack_length:
                row.extend(members)
                prompts[r].append(prompt)
                room[r] = pack_length - length
                break
        else:  # a tree longer than pack_length gets a row of its own
            rows.append(list(members))
            prompts.append([prompt])
            room.append(pack_length - size)
    return [_by_prompt(sequences, row) for row in rows]


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


def _build(sequences: list[TokenSequence], rows: list[list[int]], pad_id: int, layout: str) -> MicroBatch:
    """One micro-batch from rows of sequence indices."""
    tree = layout == "shared_prefix"
    pieces = [_pieces(sequences, row, tree) for row in rows]
    width = max(sum(len(tokens) for tokens, _, _ in row) for row in pieces)
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    logprob_mask = torch.zeros(shape, dtype=torch.bool)
    segment_ids = torch.full(shape, -1, dtype=torch.long)
    indices: list[int] = []
    for r, row in enumerate(pieces):
        start = 0
        for tokens, first, owner in row:
            n = len(tokens)
            input_ids[r, start : start + n] = torch.tensor(tokens, dtype=torch.long)
            position_ids[r, start : start + n] = torch.arange(first, first + n)
            attention_mask[r, start : start + n] = 1
            if owner is not None:  # a completion: scored, and trained where its train_mask says
                logprob_mask[r, start : start + n] = True
                train = torch.tensor(sequences[owner].train_mask, dtype=torch.bool)
                segment_ids[r, start : start + n] = torch.where(train, len(indices), -1)
                indices.append(owner)
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
        prefix_tree=tree,
    )


def make_micro_batches(
    sequences: list[TokenSequence], *, layout: str, pack_length: int, micro_batch_tokens: int, pad_id: int
) -> list[MicroBatch]:
    """Split `sequences` into micro-batches of at most `micro_batch_tokens` tokens (padding included).

    layout: "shared_prefix" (rows of prefix trees up to `pack_length` tokens: see the module docstring),
    "packed" (rows of several sequences up to `pack_length` tokens) or "padded" (one right-padded
    sequence a row).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    tree = layout == "shared_prefix"
    if tree:
        rows = _tree_rows(sequences, pack_length)
    elif layout == "padded":
        rows = [[i] for i in range(len(sequences))]
    else:
        rows = _first_fit_rows([len(seq) for seq in sequences], pack_length)
    lengths = [_row_length(sequences, row, tree) for row in rows]
    if layout != "packed":  # longest first, as first-fit decreasing gives the packed rows
        order = sorted(range(len(rows)), key=lambda k: -lengths[k])
        rows, lengths = [rows[k] for k in order], [lengths[k] for k in order]
    batches: list[MicroBatch] = []
    current: list[int] = []
    for k in range(len(rows)):  # rows come (about) longest first
        width = max(lengths[j] for j in [*current, k])
        if current and width * (len(current) + 1) > micro_batch_tokens:
            batches.append(_build(sequences, [rows[j] for j in current], pad_id, layout))
            current = []
        current.append(k)
    if current:
        batches.append(_build(sequences, [rows[j] for j in current], pad_id, layout))
    return batches


def layout_is_exact(
    score: Callable[[MicroBatch], torch.Tensor], vocab_size: int, pad_id: int, layout: str = "packed"
) -> bool:
    """Probe whether a model computes ``layout`` exactly: the log-probs of four short sequences (the third
    repeating the first one's prompt, the fourth sharing its first two tokens) must equal those of the
    padded layout. `score(mb)` returns (R*L,) log-probs."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, vocab_size, (22,), generator=generator).tolist()
    sequences = [
        TokenSequence(tokens[:3], tokens[3:8], [True] * 5),
        TokenSequence(tokens[8:10], tokens[10:14], [True] * 4),
        TokenSequence(tokens[:3], tokens[14:18], [True] * 4),  # the first one's prompt
        TokenSequence(tokens[:2] + tokens[18:19], tokens[19:], [True] * 3),  # its first two tokens
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
