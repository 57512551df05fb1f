"""Segment attention for packed rows: the layout by hand, and values and gradients equal to the mask paths."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, LlamaConfig

from gspo.config import ModelConfig
from gspo.core import attention
from gspo.core.layout import TokenSequence, make_micro_batches
from gspo.core.logprobs import causal_lm_logprobs
from gspo.models import load_model

# The tiny models' log-probs are about -log(99) = -4.6, so rtol 1e-5 allows ~5e-5 (~100 ulps). Two layouts run
# the same fp32 ops on other shapes, so in other summation orders: a sum of n <= 128 terms is off by
# ~sqrt(n)*u <= 7e-7 relative (u = 2^-24, independent rounding), ~3.5e-6 over the ~25 sums of 2 layers, and
# log pi by at most |h| |w_t - w_mean| <= 8 * 0.19 = 1.5 times the final hidden state's relative error (a head
# of 0.02-std weights): ~5e-6, 10x inside; atol is moot at |log pi| > 4. qwen3_moe's top-2 router logits are
# >= 1.6e-5 apart on these tokens, above their rounding (<= 64u * 1.3 = 5e-6): no expert choice flips. A key
# from another segment moves log pi by ~4e-2 (0.28 at most).
LOGPROBS = {"rtol": 1e-5, "atol": 2e-6}
# The gradients add the backward's sums, over up to ~500 tokens for a weight, in other orders too: ~sqrt(n)*u
# ~ 1.3e-6 more; rtol 1e-4 is ~20x the estimate, atol 1e-5 covers entries whose O(1) terms cancel. A key from
# another segment changes some gradients by ~100%.
GRADIENTS = {"rtol": 1e-4, "atol": 1e-5}
# The attention function against a naive fp32 softmax(0.3 q k^T) v on N(0, 1) inputs, bounded in any order:
# a score (8 products, 0.3 sum|q_i k_i| <= 6.5 here) is off by <= 9u * 6.5 ~ 60u; a weight by <= 2 * 60u + the
# exp (sdpa's exp_u20: 20 ulps = 40u) + a <= 10-term sum ~ 180u relative; an output (|v| <= 2.8) by
# <= (180 + 10)u * 2.8 ~ 3.2e-5 per side, 6.4e-5 both. A key missed or seen, or another scale, moves outputs
# by >= 0.1.
NAIVE_ATTENTION = {"rtol": 0.0, "atol": 1e-4}


def test_layout_of_packed_rows_by_hand() -> None:
    # row 0: segments of 3, 2, 1 tokens; row 1: 4, 2 (a row start always starts a segment)
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    layout = attention.segment_layout(position_ids, bucket_ratio=1.5)
    # lengths 4, 3 | 2, 2 | 1: buckets hold lengths within 1.5x of their longest
    assert [(b.segments, b.length) for b in layout.buckets] == [(2, 4), (2, 2), (1, 1)]
    assert layout.buckets[0].gather.tolist() == [6, 7, 8, 9, 0, 1, 2, 2]  # padded slot repeats a token
    assert layout.buckets[0].keep.tolist() == [0, 1, 2, 3, 4, 5, 6]  # slot 7 is padding
    assert layout.buckets[1].gather.tolist() == [3, 4, 10, 11]
    assert layout.buckets[2].gather.tolist() == [5]
    order = torch.cat([b.gather[b.keep] for b in layout.buckets])
    assert sorted(order.tolist()) == list(range(12))  # every token exactly once
    assert torch.equal(order[layout.inverse], torch.arange(12))


def _sequences(seed: int) -> list[TokenSequence]:
    """Mixed lengths (3..60 tokens): several buckets, and rows holding several sequences."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n_prompt in (2, 40, 5, 17, 3, 50, 9, 1):
        prompt = torch.randint(3, 90, (n_prompt,), generator=g).tolist()
        completion = torch.randint(3, 90, (int(torch.randint(1, 10, (), generator=g)),), generator=g).tolist()
        out.append(TokenSequence(prompt, completion, [True] * len(completion)))
    return out


def _logprobs_and_grads(model, mb, weights):
    model.zero_grad(set_to_none=True)
    logp = causal_lm_logprobs(
        model,
        mb.input_ids,
        attention_mask=mb.attention_mask,
        position_ids=mb.position_ids,
        logprob_mask=mb.logprob_mask,
    )
    (logp * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    # completion-token log-probs in sequence order, whatever the layout
    per_sequence = {i: logp.reshape(-1)[mb.segment_ids == k] for k, i in enumerate(mb.indices)}
    return torch.cat([per_sequence[i] for i in sorted(per_sequence)]).detach(), grads


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_segment_attention_equals_the_block_diagonal_mask_and_the_padded_layout(family, monkeypatch):
    model, _ = load_model(ModelConfig(tiny=family), seed=0)
    sequences = _sequences(1)
    packed, padded = (
        make_micro_batches(sequences, layout=layout, pack_length=80, micro_batch_tokens=4096, pad_id=0)[0]
        for layout in ("packed", "padded")
    )
    assert packed.input_ids.shape[0] > 1 and len(packed.indices) > packed.input_ids.shape[0]
    weights = torch.randn(packed.input_ids.shape, generator=torch.Generator().manual_seed(5))
    calls = []
    forward = AttentionInterface._global_mapping[attention.NAME]
    monkeypatch.setitem(
        AttentionInterface._global_mapping,
        attention.NAME,
        lambda *a, **k: calls.append(1) or forward(*a, **k),
    )
    segments = _logprobs_and_grads(model, packed, weights)
    assert len(calls) == model.config.num_hidden_layers  # the segment path ran, once per layer
    assert model.config._attn_implementation == "sdpa"  # restored after the pass

    monkeypatch.setattr(attention, "supports_segments", lambda model: False)
    mask = _logprobs_and_grads(model, packed, weights)  # transformers' block-diagonal mask
    assert len(calls) == model.config.num_hidden_layers
    torch.testing.assert_close(segments[0], mask[0], **LOGPROBS)  # LOGPROBS: see its definition
    assert segments[1].keys() == mask[1].keys()
    for name, grad in mask[1].items():
        torch.testing.assert_close(segments[1][name], grad, **GRADIENTS, msg=name)  # see its definition

    # the padded layout (one sequence per row) scores the same tokens
    padded_logp, _ = _logprobs_and_grads(model, padded, torch.zeros(padded.input_ids.shape))
    torch.testing.assert_close(segments[0], padded_logp, **LOGPROBS)  # LOGPROBS: see its definition


def test_unsupported_models_keep_their_attention() -> None:
    model, _ = load_model(ModelConfig(tiny="llama"), seed=0)
    position_ids = torch.tensor([[0, 1, 0, 1]])
    model.config.sliding_window = 2
    with attention.segment_attention(model, position_ids) as used:
        assert not used and model.config._attn_implementation == "sdpa"
    model.config.sliding_window = None
    # transformers' name for it from 5.2x on; gradient_checkpointing_* before (pyproject allows both)
    prefix = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"
    getattr(model, f"{prefix}_checkpointing_enable")()
    with attention.segment_attention(model, position_ids) as used:
        assert not used
    getattr(model, f"{prefix}_checkpointing_disable")()
    with pytest.raises(ValueError, match="boom"), attention.segment_attention(model, position_ids) as used:
        assert used and model.config._attn_implementation == attention.NAME
        raise ValueError("boom")
    assert model.config._attn_implementation == "sdpa"  # restored on the way out of an error


def _attend(position_ids, seed: int, prefix_tree: bool = False):
    """The registered attention function called directly on random (B, 4, T, 8) queries, (B, 2, T, 8) keys
    and (B, 2, T, 5) values (grouped-query heads, another value size), scale 0.3; returns q, k, v, out."""
    g = torch.Generator().manual_seed(seed)
    batch, width = position_ids.shape
    query = torch.randn(batch, 4, width, 8, generator=g)
    key = torch.randn(batch, 2, width, 8, generator=g)
    value = torch.randn(batch, 2, width, 5, generator=g)
    token = attention._LAYOUT.set(attention.segment_layout(position_ids, prefix_tree))
    try:
        out, _ = attention._segment_attention_forward(torch.nn.Module(), query, key, value, None, scaling=0.3)
    finally:
        attention._LAYOUT.reset(token)
    return query, key, value, out


def test_attention_function_equals_causal_attention_per_segment_with_gqa_and_another_value_size() -> None:
    """Called directly: 4 query heads over 2 key/value heads, head size 8 for q/k and 5 for v."""
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 0, 1, 2], [0, 1, 2, 0, 1, 2, 3, 4, 5, 6]])
    query, key, value, out = _attend(position_ids, seed=0)
    assert out.shape == (2, 10, 4, 5)
    for row, bounds in ((0, [(0, 5), (5, 7), (7, 10)]), (1, [(0, 3), (3, 10)])):
        for start, end in bounds:
            q = query[row, :, start:end]
            k = key[row, :, start:end].repeat_interleave(2, dim=0)  # query head h reads kv head h // 2
            v = value[row, :, start:end].repeat_interleave(2, dim=0)
            scores = (q @ k.transpose(-1, -2)) * 0.3
            scores = scores.masked_fill(torch.ones(end - start, end - start).triu(1).bool(), float("-inf"))
            expected = (scores.softmax(-1) @ v).transpose(0, 1)  # (L, H, Dv)
            # NAIVE_ATTENTION: see its definition
            torch.testing.assert_close(out[row, start:end], expected, **NAIVE_ATTENTION)


def test_models_with_attention_code_of_their_own_keep_their_mask() -> None:
    class OwnAttention(torch.nn.Module):  # no _supports_attention_backend: it would ignore the interface
        def __init__(self) -> None:
            super().__init__()
            # sdpa, no window: only the missing AttentionInterface dispatch disqualifies it
            self.config = LlamaConfig(attn_implementation="sdpa")

    assert not attention.supports_segments(OwnAttention())


def test_tree_attention_equals_each_completion_attending_to_its_prompt_and_itself() -> None:
    """Called directly on shared-prefix rows: a naive loop over each completion as prompt + completion."""
    # row 0: a tree with a 3-token prompt and completions of 2, 1, 3 tokens, then a plain 2-token tree;
    # row 1: a tree with a 2-token prompt and two completions of 2 tokens
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 3, 3, 4, 5, 0, 1], [0, 1, 2, 3, 2, 3, 0, 0, 0, 0, 0]])
    query, key, value, out = _attend(position_ids, seed=1, prefix_tree=True)

    def naive(row: int, prompt: list[int], completion: list[int]) -> torch.Tensor:
        """Causal attention over the prompt's and the completion's tokens, for the completion's queries."""
        seen = prompt + completion
        q = query[row][:, completion]
        k = key[row][:, seen].repeat_interleave(2, dim=0)
        v = value[row][:, seen].repeat_interleave(2, dim=0)
        scores = (q @ k.transpose(-1, -2)) * 0.3
        causal = torch.ones(len(completion), len(seen)).triu(len(prompt) + 1).bool()
        return (scores.masked_fill(causal, float("-inf")).softmax(-1) @ v).transpose(0, 1)

    cases = [(0, [0, 1, 2], [3, 4]), (0, [0, 1, 2], [5]), (0, [0, 1, 2], [6, 7, 8]), (0, [9], [10])]
    cases += [(1, [0, 1], [2, 3]), (1, [0, 1], [4, 5])]
    for row, prompt, completion in cases:
        # NAIVE_ATTENTION: see its definition
        torch.testing.assert_close(out[row, completion], naive(row, prompt, completion), **NAIVE_ATTENTION)
    # the prompt itself; NAIVE_ATTENTION: see its definition
    torch.testing.assert_close(out[0, :3], naive(0, [], [0, 1, 2]), **NAIVE_ATTENTION)


def test_tree_attention_over_a_trie_sees_exactly_each_token_s_ancestors() -> None:
    """A prefix tree that branches inside the prompt too (depth-first, position = depth): by hand, each
    token's ancestors; the attention equals a naive softmax over exactly those keys, and the log-prob
    path's parents are the hand-read ones."""
    from gspo.core.logprobs import _tree_parents

    # 0 -> 1 -> 2 -> 3 -> 4;  1 -> 5 -> 6 -> 7;  5 -> 8;  0 -> 9 -> 10;  then padding (a new root)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 2, 3, 4, 3, 1, 2, 0]])
    parents = [None, 0, 1, 2, 3, 1, 5, 6, 5, 0, 9, None]
    query, key, value, out = _attend(position_ids, seed=2, prefix_tree=True)
    for t in range(12):
        seen = [t]
        while parents[seen[-1]] is not None:
            seen.append(parents[seen[-1]])
        k = key[0][:, seen].repeat_interleave(2, dim=0)
        v = value[0][:, seen].repeat_interleave(2, dim=0)
        expected = ((query[0][:, [t]] @ k.transpose(-1, -2)) * 0.3).softmax(-1) @ v  # (H, 1, Dv)
        # NAIVE_ATTENTION: see its definition
        torch.testing.assert_close(out[0, t], expected[:, 0], **NAIVE_ATTENTION, msg=f"token {t}")
    has_parent, flat = _tree_parents(position_ids)
    assert has_parent[0].tolist() == [p is not None for p in parents]
    assert [int(flat[0, t]) for t in range(12) if parents[t] is not None] == [
        p for p in parents if p is not None
    ]


def _groups(seed: int) -> list[TokenSequence]:
    """Four groups of 1 to 4 completions of 1..9 tokens; prompts of 30, 2, 11 and 7 tokens, the third
    continuing the second and the fourth sharing the first one's first 5 tokens (a trie, not just groups)."""
    g = torch.Generator().manual_seed(seed)
    first = torch.randint(3, 90, (30,), generator=g).tolist()
    second = torch.randint(3, 90, (2,), generator=g).tolist()
    prompts = [first, second, second + torch.randint(3, 90, (9,), generator=g).tolist()]
    prompts.append(first[:5] + torch.randint(3, 90, (2,), generator=g).tolist())
    out = []
    for prompt, samples in zip(prompts, (4, 3, 1, 4), strict=True):
        for _ in range(samples):
            completion = torch.randint(
                3, 90, (int(torch.randint(1, 10, (), generator=g)),), generator=g
            ).tolist()
            out.append(TokenSequence(prompt, completion, [True] * len(completion)))
    return out


def _shared_logprobs_and_grads(model, mb):
    model.zero_grad(set_to_none=True)
    logp = causal_lm_logprobs(
        model,
        mb.input_ids,
        attention_mask=mb.attention_mask,
        position_ids=mb.position_ids,
        logprob_mask=mb.logprob_mask,
        prefix_tree=mb.prefix_tree,
    )
    flat = logp.reshape(-1)
    per_sequence = {i: flat[mb.segment_ids == k] for k, i in enumerate(mb.indices)}
    values = torch.cat([per_sequence[i] for i in sorted(per_sequence)])
    # a weight per sequence, the same whatever the layout
    (
        values * torch.cat([torch.full_like(per_sequence[i], 1.0 + i / 10) for i in sorted(per_sequence)])
    ).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return values.detach(), grads


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "llama+lora"])
def test_shared_prefix_rows_give_the_padded_layout_s_logprobs_and_gradients(family):
    """One prefix-tree row against one padded row per sequence: fp32, the same math summed in another order
    (the prompt's keys reached through a mask over the tree instead of one padded row per sequence; a shared
    token's gradient summed over its sequences in one pass): LOGPROBS and GRADIENTS."""
    model, _ = load_model(ModelConfig(tiny=family.split("+")[0]), seed=0)
    if family.endswith("lora"):
        from gspo.config import LoraConfig
        from gspo.models import add_lora

        model = add_lora(model, LoraConfig(rank=4, target_modules=["q_proj", "v_proj"]))
        for name, param in model.named_parameters():  # adapters away from zero, so their gradients matter
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.1, generator=torch.Generator().manual_seed(0))
    sequences = _groups(2)
    shared, padded = (
        make_micro_batches(sequences, layout=layout, pack_length=128, micro_batch_tokens=4096, pad_id=0)[0]
        for layout in ("shared_prefix", "padded")
    )
    trie = 30 + 2 + 9 + 2 + sum(len(s.completion_ids) for s in sequences)  # each distinct prompt prefix once
    assert shared.input_ids.shape[0] == 1 and int((shared.input_ids != 0).sum()) == trie
    got, want = _shared_logprobs_and_grads(model, shared), _shared_logprobs_and_grads(model, padded)
    torch.testing.assert_close(got[0], want[0], **LOGPROBS)  # LOGPROBS: see its definition
    assert got[1].keys() == want[1].keys() and got[1]
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, **GRADIENTS, msg=name)  # see its definition


def test_shared_prefix_rows_need_segment_attention() -> None:
    model, _ = load_model(ModelConfig(tiny="llama"), seed=0)
    model.config.sliding_window = 2
    position_ids = torch.tensor([[0, 1, 2, 2]])
    with (
        pytest.raises(ValueError, match=r"cannot compute shared-prefix rows.*train\.layout=packed"),
        attention.segment_attention(model, position_ids, prefix_tree=True),
    ):
        pass


def test_prefix_tree_rows_without_a_parent_before_each_token_are_refused() -> None:
    from gspo.core.logprobs import _tree_parents

    with pytest.raises(ValueError, match=r"parent before it \(trees depth-first, position_ids the depth\)"):
        _tree_parents(torch.tensor([[0, 1, 3, 2]]))  # depth 3 right after depth 1: no depth-2 parent
    model, _ = load_model(ModelConfig(tiny="llama"), seed=0)
    with pytest.raises(ValueError, match="prefix_tree rows need position_ids and no attention_mask"):
        causal_lm_logprobs(model, torch.tensor([[3, 4]]), attention_mask=torch.ones(1, 2), prefix_tree=True)
