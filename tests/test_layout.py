"""Prefix-tree, packed and padded micro-batch layouts: every completion token lands once, in order, with its
segment; prefix trees compute each distinct prompt prefix once and keep every sequence whole."""

from __future__ import annotations

import pytest
import torch

from gspo.core.layout import TokenSequence, layout_is_exact, make_micro_batches


def _sequences() -> list[TokenSequence]:
    return [
        TokenSequence([10, 11, 12], [20, 21], [True, True]),
        TokenSequence([13], [22, 23, 24, 25], [True, False, True, True]),
        TokenSequence([14, 15, 16, 17, 18], [26], [True]),
        TokenSequence([19, 19], [27, 28, 29], [False, False, False]),
    ]


def _check_layout(sequences: list[TokenSequence], batches, packed: bool) -> None:
    seen = []
    for mb in batches:
        ids = mb.input_ids.reshape(-1)
        pos = mb.position_ids.reshape(-1)
        lp = mb.logprob_mask.reshape(-1)
        completion_tokens = ids[lp].tolist()
        assert completion_tokens == [t for i in mb.indices for t in sequences[i].completion_ids]
        expected_segments = [
            k if trained else -1 for k, i in enumerate(mb.indices) for trained in sequences[i].train_mask
        ]
        assert mb.segment_ids[lp].tolist() == expected_segments
        assert (mb.segment_ids[~lp] == -1).all()
        # each sequence starts at position 0 and counts up over prompt + completion
        for i in mb.indices:
            full = sequences[i].prompt_ids + sequences[i].completion_ids
            starts = [j for j in range(len(ids)) if pos[j] == 0 and ids[j : j + len(full)].tolist() == full]
            assert starts, f"sequence {i} not found contiguous"
            j = starts[0]
            assert pos[j : j + len(full)].tolist() == list(range(len(full)))
        assert (mb.attention_mask is None) == packed
        seen.extend(mb.indices)
    assert sorted(seen) == list(range(len(sequences)))


def test_packed_rows_hold_several_sequences() -> None:
    seqs = _sequences()
    batches = make_micro_batches(seqs, layout="packed", pack_length=12, micro_batch_tokens=1000, pad_id=0)
    _check_layout(seqs, batches, packed=True)
    assert len(batches) == 1
    # lengths 5, 5, 6, 5 -> rows of <= 12 tokens: two rows, (6+5) and (5+5)
    assert batches[0].input_ids.shape == (2, 11)


def test_padded_rows_hold_one_sequence_each() -> None:
    seqs = _sequences()
    batches = make_micro_batches(seqs, layout="padded", pack_length=12, micro_batch_tokens=1000, pad_id=0)
    _check_layout(seqs, batches, packed=False)
    mb = batches[0]
    assert mb.input_ids.shape == (4, 6)
    assert mb.attention_mask.sum().item() == sum(len(s) for s in seqs)


def test_micro_batches_respect_the_token_budget() -> None:
    seqs = _sequences() * 3
    batches = make_micro_batches(seqs, layout="padded", pack_length=12, micro_batch_tokens=13, pad_id=0)
    assert all(mb.num_tokens <= 13 for mb in batches)
    _check_layout(seqs, batches, packed=False)


def test_a_sequence_longer_than_the_pack_length_gets_its_own_row() -> None:
    seqs = [TokenSequence(list(range(1, 20)), [30, 31], [True, True]), TokenSequence([1], [2], [True])]
    batches = make_micro_batches(seqs, layout="packed", pack_length=8, micro_batch_tokens=1000, pad_id=0)
    _check_layout(seqs, batches, packed=True)
    assert batches[0].input_ids.shape[0] == 2
    assert torch.equal(batches[0].input_ids[0, :21], torch.tensor([*range(1, 20), 30, 31]))


def test_packing_probe_detects_attention_that_mixes_sequences() -> None:
    def per_token(mb):  # depends only on the token and its position in its own sequence: packing-safe
        return (mb.input_ids * 0.01 + mb.position_ids * 0.1).float().reshape(-1)

    def mixing(mb):  # a running sum over the whole row: packed sequences leak into each other
        return mb.input_ids.float().cumsum(-1).reshape(-1)

    assert layout_is_exact(per_token, vocab_size=50, pad_id=0)
    assert not layout_is_exact(mixing, vocab_size=50, pad_id=0)


def test_packing_probe_passes_on_a_real_tiny_llama() -> None:
    from gspo.learning.policy import UpdateSpec, score
    from gspo.models import tiny_model

    model = tiny_model("llama", vocab_size=99, seed=0)
    with torch.no_grad():
        assert layout_is_exact(lambda mb: score(model, mb, UpdateSpec()), vocab_size=99, pad_id=0)


def test_a_micro_batch_moves_every_tensor_and_keeps_its_indices() -> None:
    for packed in (True, False):
        (mb,) = make_micro_batches(
            _sequences(),
            layout="packed" if packed else "padded",
            pack_length=64,
            micro_batch_tokens=1024,
            pad_id=0,
        )
        assert mb.to(torch.device("cpu")) is mb  # already there: no copy
        moved = mb.to(torch.device("meta"))
        assert moved.indices == mb.indices
        for name in ("input_ids", "position_ids", "logprob_mask", "segment_ids"):
            tensor = getattr(moved, name)
            assert tensor.device.type == "meta"
            assert (tensor.shape, tensor.dtype) == (getattr(mb, name).shape, getattr(mb, name).dtype)
        assert (moved.attention_mask is None) == packed
        assert packed or moved.attention_mask.device.type == "meta"


def _groups() -> list[TokenSequence]:
    """Three groups (prompts of 4, 2 and 3 tokens) of completions of varied lengths, some untrained."""
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    completions = [[[20, 21], [22], [23, 24, 25]], [[26, 27, 28, 29], [30]], [[31, 32], [33, 34], [35]]]
    return [
        TokenSequence(prompt, c, [k != 1] * len(c))
        for prompt, group in zip(prompts, completions, strict=True)
        for k, c in enumerate(group)
    ]


def _walk_up(mb, row: int, t: int) -> list[int]:
    """The positions a prefix-tree position continues, read naively: from ``t``, step to the last earlier
    position one level up (its parent in depth-first order) until the root; returns them root first."""
    pos = mb.position_ids[row].tolist()
    path = [t]
    while pos[path[-1]] > 0:
        path.append(max(u for u in range(path[-1]) if pos[u] == pos[path[-1]] - 1))
    return path[::-1]


def _check_tree_rows(seqs: list[TokenSequence], mb) -> None:
    """Every sequence is recovered whole by walking up from its last token; its completion tokens are
    scored in `indices` order with their segments; each tree computes each of its prompt prefixes once."""
    lp = mb.logprob_mask
    expected_segments = [
        k if trained else -1 for k, i in enumerate(mb.indices) for trained in seqs[i].train_mask
    ]
    assert mb.segment_ids[lp.reshape(-1)].tolist() == expected_segments
    positions = lp.nonzero().tolist()  # (row, t) of completion tokens, in indices order
    k, trees = 0, {}
    for i in mb.indices:
        n = len(seqs[i].completion_ids)
        row, t = positions[k + n - 1]
        path = _walk_up(mb, row, t)
        assert mb.input_ids[row, path].tolist() == seqs[i].prompt_ids + seqs[i].completion_ids, i
        trees.setdefault((row, path[0]), []).append(i)
        k += n
    assert k == len(positions)
    prompt_tokens = {}
    for (row, _), held in trees.items():  # a tree's prompt tokens: the distinct prompt prefixes it holds
        prefixes = {
            tuple(seqs[i].prompt_ids[:n]) for i in held for n in range(1, len(seqs[i].prompt_ids) + 1)
        }
        prompt_tokens[row] = prompt_tokens.get(row, 0) + len(prefixes)
    for row, expected in prompt_tokens.items():  # pad_id 0 aside
        assert int(((mb.input_ids[row] != 0) & ~lp[row]).sum()) == expected


def test_shared_prefix_rows_hold_each_prompt_once_and_continue_its_positions() -> None:
    seqs = _groups()
    (mb,) = make_micro_batches(
        seqs, layout="shared_prefix", pack_length=64, micro_batch_tokens=1000, pad_id=0
    )
    assert mb.attention_mask is None and mb.prefix_tree
    unique = sum(len(p) for p in ([5, 6, 7, 8], [9, 10], [11, 12, 13])) + sum(
        len(s.completion_ids) for s in seqs
    )
    assert int((mb.input_ids != 0).sum()) == unique == 25  # every prompt once: 9 + 16 tokens
    _check_tree_rows(seqs, mb)
    # a group: its prompt at positions 0.., then each completion at positions len(prompt)..
    ids, pos = mb.input_ids.reshape(-1).tolist(), mb.position_ids.reshape(-1).tolist()
    j = ids.index(9)
    assert ids[j : j + 7] == [9, 10, 26, 27, 28, 29, 30] and pos[j : j + 7] == [0, 1, 2, 3, 4, 5, 2]


def test_prompts_sharing_a_start_share_it_in_one_tree() -> None:
    """A system message common to every prompt, a prompt that is the start of another: each distinct
    prompt prefix is computed once (a trie's nodes), and every sequence reads back whole."""
    system = [3, 4, 5]
    prompts = [[*system, 6, 7], [*system, 6, 7, 8, 9], [*system, 10], [*system, 6, 11], [12, 13]]
    seqs = [
        TokenSequence(prompt, [20 + 3 * p + k] * (k + 1), [k != 1] * (k + 1))
        for p, prompt in enumerate(prompts)
        for k in range(3)
    ]
    (mb,) = make_micro_batches(
        seqs, layout="shared_prefix", pack_length=128, micro_batch_tokens=1000, pad_id=0
    )
    assert mb.input_ids.shape[0] == 1  # one row, one tree per distinct first token
    prefixes = {tuple(p[:k]) for p in prompts for k in range(1, len(p) + 1)}
    completions = sum(len(s.completion_ids) for s in seqs)
    assert int((mb.input_ids != 0).sum()) == len(prefixes) + completions == 11 + 30
    _check_tree_rows(seqs, mb)
    # packed rows compute every prompt whole for every sample
    (packed,) = make_micro_batches(seqs, layout="packed", pack_length=128, micro_batch_tokens=1000, pad_id=0)
    assert int((packed.input_ids != 0).sum()) == 3 * sum(map(len, prompts)) + completions


def test_tree_rows_fill_by_what_a_prompt_adds() -> None:
    """Two groups sharing a 6-token start fit a 16-token row together (6 + 2 * (1 + 3) = 14), though each
    counts 6 + 1 + 3 = 10 alone; a group of another prompt (10 tokens) then needs a new row."""
    system = [3, 4, 5, 6, 7, 8]
    seqs = [TokenSequence([*system, 10 + g], [30 + g, 31, 32], [True] * 3) for g in range(2)]
    seqs += [TokenSequence([40] * 7, [41, 42, 43], [True] * 3)]
    batches = make_micro_batches(
        seqs, layout="shared_prefix", pack_length=16, micro_batch_tokens=1000, pad_id=0
    )
    (mb,) = batches
    assert mb.input_ids.shape[0] == 2
    rows = sorted(int((r != 0).sum()) for r in mb.input_ids)
    assert rows == [10, 14]
    _check_tree_rows(seqs, mb)


def test_a_tree_longer_than_pack_length_repeats_its_prompt_in_a_new_tree() -> None:
    prompt = [5, 6, 7, 8]
    seqs = [TokenSequence(prompt, [20 + k] * 3, [True] * 3) for k in range(4)]  # 4 + 4 * 3 = 16 tokens
    batches = make_micro_batches(
        seqs, layout="shared_prefix", pack_length=10, micro_batch_tokens=1000, pad_id=0
    )
    ids = torch.cat([mb.input_ids.reshape(-1) for mb in batches])
    assert int((ids == 5).sum()) == 2  # two trees of two completions: 4 + 3 + 3 = 10 tokens each
    assert sorted(i for mb in batches for i in mb.indices) == [0, 1, 2, 3]


def test_the_layout_probe_catches_a_model_that_ignores_the_branches() -> None:
    def per_token(mb):  # log-probs that depend on the token alone: any exact layout agrees
        return -(mb.input_ids.reshape(-1).float() / 100) * mb.logprob_mask.reshape(-1)

    def causal_sum(mb):  # a running sum along each tree, ignoring branches: siblings leak into each other
        restart = mb.position_ids.reshape(-1) == 0
        values, total = [], 0.0
        for token, start in zip(mb.input_ids.reshape(-1).tolist(), restart.tolist(), strict=True):
            total = (0.0 if start else total) + token
            values.append(total / 1000)
        return torch.tensor(values) * mb.logprob_mask.reshape(-1)

    assert layout_is_exact(per_token, vocab_size=50, pad_id=0, layout="shared_prefix")
    assert layout_is_exact(causal_sum, vocab_size=50, pad_id=0, layout="packed")
    assert not layout_is_exact(causal_sum, vocab_size=50, pad_id=0, layout="shared_prefix")


def test_unknown_layout_is_named() -> None:
    with pytest.raises(ValueError, match="unknown layout 'trees'"):
        make_micro_batches(_groups(), layout="trees", pack_length=64, micro_batch_tokens=1000, pad_id=0)


@pytest.mark.parametrize(("start", "trees"), [(1, 2), (40, 1)])
def test_groups_share_a_start_in_one_tree_only_when_it_saves_more_than_the_tree_s_attention(start, trees):
    """Two groups of 2 samples with 100-token completions, prompts of ``start`` common tokens and 20 of their
    own. The second group's first sample adds n = 120 tokens to a tree of T = start + 20 + 200. A 1-token
    start (a BOS): 1 x 1536 < 221 x 120 (layout.MERGE_WIDTH), two trees; a 40-token start:
    40 x 1536 = 61,440 >= 260 x 120 = 31,200, one tree."""
    common = list(range(3, 3 + start))
    seqs = [
        TokenSequence([*common, *range(100 + 20 * g, 120 + 20 * g)], [200 + g] * 100, [True] * 100)
        for g in range(2)
        for _ in range(2)
    ]
    (mb,) = make_micro_batches(
        seqs, layout="shared_prefix", pack_length=2048, micro_batch_tokens=4096, pad_id=0
    )
    assert mb.input_ids.shape[0] == 1
    roots = int(((mb.position_ids == 0) & (mb.input_ids != 0)).sum())
    assert roots == trees
    assert int((mb.input_ids != 0).sum()) == start * trees + 2 * 20 + 4 * 100
    _check_tree_rows(seqs, mb)
