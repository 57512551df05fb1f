"""The sampling engine (gspo.rollout.hf_engine): its log-probs against the trainer's recomputation for every
architecture it drives, continuous batching (refill, cancel), seeded streams, stopping and the draw."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import dataclasses
import threading
import time

import pytest
import torch

from gspo.config import LoraConfig
from gspo.core.logprobs import causal_lm_logprobs
from gspo.core.seeds import stream_key
from gspo.models import add_lora
from gspo.models.loading import tiny_model, tiny_tokenizer
from gspo.rollout.draws import Row, _inverse_cdf, draw, uniform
from gspo.rollout.hf_engine import Engine
from gspo.rollout.requests import Request, SamplingParams

EOS = 2
VOCAB = len(tiny_tokenizer())
PROMPTS = [[5, 9, 14, 3, 30, 41, 7, 8, 60, 11], [20], [33, 34, 35, 36, 37], [70, 71, 12]]
# The same fp32 model's log-probs computed in other shapes (cached decoding, prefill rows, decode batches of
# other sizes and cache widths; the trainer's whole sequences), so summed in other orders. A sum of n <= 160
# terms of random signs is off by ~0.4*sqrt(n)*u rms relative (u = 2^-24, independent rounding): e ~ 1.5e-6
# over the ~25 sums of 2 layers. log pi (~ -4.6) moves by dh . (w_t - w_mean), for dh of relative size e in a
# random direction ~e |h| |w_t - w_mean| / sqrt(64) = 0.2e (0.5e with weights moved by 0.05), plus ~1 ulp
# (5e-7) of its own rounding: ~1e-6 rms, so 1e-5 is ~10 sigma. qwen3_moe's top-2 router logits are >= 2e-4
# apart here: no expert choice flips. A key missed moves log pi by ~0.1, a decode position off by one by up to
# 2e-3 (tiny random models barely use positions).
LOGPROB_ATOL = 1e-5


def _sliding_qwen3(seed: int = 0) -> torch.nn.Module:
    """Layer 0 attends to everything, layer 1 within a window of 4 (shorter than every sequence here)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=EOS,
        pad_token_id=0,
    )
    assert config.layer_types == ["full_attention", "sliding_attention"]
    return Qwen3ForCausalLM(config).eval()


def _lora_llama(seed: int = 0) -> torch.nn.Module:
    """Tiny Llama with LoRA adapters whose B is not zero, so the adapters change every projection."""
    model = add_lora(tiny_model("llama", VOCAB, seed), LoraConfig(rank=4, alpha=8.0))
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2)
    return model.eval()


MODELS = {
    "llama_gqa": lambda: tiny_model("llama", VOCAB, 0).eval(),  # 4 query heads, 2 kv heads
    "qwen3_moe": lambda: tiny_model("qwen3_moe", VOCAB, 0).eval(),
    "lora": _lora_llama,
    "sliding_window": _sliding_qwen3,
}


def _recomputed(model: torch.nn.Module, request: Request) -> list[torch.Tensor]:
    """The trainer's fp32 log-probs of each sample's completion (one sequence at a time, no cache)."""
    out = []
    for sample in request.samples:
        ids = torch.tensor([request.prompt_ids + sample.token_ids])
        with torch.no_grad():
            out.append(causal_lm_logprobs(model, ids)[0, len(request.prompt_ids) :])
    return out


def _assert_exact(model: torch.nn.Module, requests: list[Request]) -> None:
    for request in requests:
        for sample, want in zip(request.samples, _recomputed(model, request), strict=True):
            assert sample.finish_reason in ("stop", "length")
            # LOGPROB_ATOL: see its definition
            torch.testing.assert_close(torch.tensor(sample.logprobs), want, atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_logprobs_equal_the_trainers_recomputation(name: str) -> None:
    """More samples than slots, per-request lengths: slots are refilled, prompts copied into late slots."""
    model = MODELS[name]()
    engine = Engine(model, slots=3, stop_token_ids=[EOS])
    requests = [
        engine.submit(prompt, 3, SamplingParams(max_new_tokens=6 + 5 * j, seed=j))
        for j, prompt in enumerate(PROMPTS)
    ]
    steps = 0
    while not engine.idle:
        engine.step()
        steps += 1
    _assert_exact(model, requests)
    lengths = [len(s.token_ids) for r in requests for s in r.samples]
    assert len(set(lengths)) > 3  # samples ended at different lengths
    assert steps < sum(lengths)  # and decoded together


SYSTEM = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]  # a start shared by every prompt (a chat template)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_start_the_prompts_share_is_computed_once(name: str) -> None:
    """Prompts that begin alike (the same 11 tokens, and 3 more for two of them; one prompt only 1 token
    longer than the start): the start runs once, in a row of its own, then each prompt's rest at its
    positions after it; the log-probs are still the trainer's, and the samples those of an engine that
    computes each prompt whole (sliding window: layer 1's window of 4 ends inside the start)."""
    prompts = [[*SYSTEM, 5, 9, 14, 3], [*SYSTEM, 5, 9, 14, 60, 61], [*SYSTEM, 20], [*SYSTEM, 33, 34]]
    model = MODELS[name]()
    forwards = []  # (rows, tokens) of every forward
    decoder = model.get_base_model().model if name == "lora" else model.model
    decoder.embed_tokens.register_forward_hook(lambda m, args, out: forwards.append(tuple(args[0].shape)))
    params = SamplingParams(max_new_tokens=6, seed=3)
    engine = Engine(model, slots=8, stop_token_ids=[EOS])
    requests = engine.generate(prompts, 2, params)
    assert [shape for shape in forwards if shape[1] > 1] == [(1, 11), (4, 5)]  # 11 + 4 x 5, not 4 x 16
    assert engine.computed_tokens == 11 + 4 * 5 + sum(
        len(s.token_ids) - 1 for r in requests for s in r.samples
    )
    _assert_exact(model, requests)
    whole = Engine(model, slots=8, stop_token_ids=[EOS])  # one prompt per prefill: nothing shared
    for request in requests:
        alone = whole.submit(request.prompt_ids, 2, dataclasses.replace(params, seed=request.seed))
        while not whole.idle:
            whole.step()
        for ours, theirs in zip(request.samples, alone.samples, strict=True):
            assert ours.token_ids == theirs.token_ids
            # LOGPROB_ATOL (see its definition): a shared start and the rest vs each prompt whole
            torch.testing.assert_close(ours.logprobs, theirs.logprobs, atol=LOGPROB_ATOL, rtol=0)


def test_each_prompt_is_computed_once_and_slots_are_refilled() -> None:
    model = MODELS["llama_gqa"]()
    rows = []  # (rows, tokens) of every forward
    model.model.embed_tokens.register_forward_hook(lambda m, args, out: rows.append(tuple(args[0].shape)))
    engine = Engine(model, slots=4, stop_token_ids=[])
    params = SamplingParams(max_new_tokens=5, seed=0)
    short = engine.submit(PROMPTS[0], 6, params)  # 6 samples, 4 slots: 2 start 5 steps later
    late = engine.submit(PROMPTS[2], 2, SamplingParams(max_new_tokens=3, seed=1))
    steps = 0
    while not engine.idle:
        engine.step()
        steps += 1
    prefills = [shape for shape in rows if shape[1] > 1]
    assert prefills == [(1, 10), (1, 5)]  # each prompt once; the second when its first sample started
    # step 5 ends the first 4 samples and starts the last 4 in their slots: its decode has 4 rows
    assert [shape[0] for shape in rows if shape[1] == 1] == [4, 4, 4, 4, 4, 4, 2, 2]
    assert steps == 9
    _assert_exact(model, [short, late])


def test_the_cache_grows_under_running_samples() -> None:
    """The first request needs 128 tokens per slot; a later, longer one grows the cache to 256 while the
    first still decodes (its cached keys and values carried over)."""
    model = MODELS["llama_gqa"]()
    engine = Engine(model, slots=2, stop_token_ids=[])
    short = engine.submit(PROMPTS[0], 1, SamplingParams(max_new_tokens=40, seed=0))
    for _ in range(20):
        engine.step()
    assert engine._cache.capacity == 128
    long = engine.submit(PROMPTS[2], 1, SamplingParams(max_new_tokens=150, seed=1))
    while not engine.idle:
        engine.step()
        if engine._slots:
            assert engine._cache.capacity == 256
    _assert_exact(model, [short, long])


def test_requests_with_the_same_prompt_share_its_computation() -> None:
    model = MODELS["llama_gqa"]()
    prefills = []
    model.model.embed_tokens.register_forward_hook(
        lambda m, args, out: prefills.append(args[0].shape[0]) if args[0].shape[1] > 1 else None
    )
    engine = Engine(model, slots=2, stop_token_ids=[])
    episodes = [engine.submit(PROMPTS[0], 1, SamplingParams(max_new_tokens=3 + j, seed=j)) for j in range(5)]
    other = engine.submit(PROMPTS[2], 1, SamplingParams(max_new_tokens=2, seed=9))
    while not engine.idle:
        engine.step()
    assert prefills == [1, 1]  # PROMPTS[0] once for its 5 requests (started over 4 steps), then PROMPTS[2]
    _assert_exact(model, [*episodes, other])


def test_the_same_seed_gives_the_same_samples_whatever_shares_the_batch() -> None:
    model = MODELS["llama_gqa"]()
    params = SamplingParams(max_new_tokens=12, seed=123)
    alone = Engine(model, slots=4, stop_token_ids=[EOS])
    mine = alone.submit(PROMPTS[2], 4, params)
    while not alone.idle:
        alone.step()
    crowded = Engine(model, slots=3, stop_token_ids=[EOS])  # other work first, fewer slots
    crowded.submit(PROMPTS[0], 5, SamplingParams(max_new_tokens=7, seed=9))
    crowded.step()
    again = crowded.submit(PROMPTS[2], 4, params)
    crowded.submit(PROMPTS[1], 2, SamplingParams(max_new_tokens=20, seed=8))
    while not crowded.idle:
        crowded.step()
    assert [s.token_ids for s in again.samples] == [s.token_ids for s in mine.samples]
    for a, b in zip(again.samples, mine.samples, strict=True):
        # LOGPROB_ATOL (see its definition): decode batches of other sizes and cache widths round otherwise
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=LOGPROB_ATOL, rtol=0
        )
    other = Engine(model, slots=4, stop_token_ids=[EOS]).generate(
        [PROMPTS[2]], 4, SamplingParams(max_new_tokens=12, seed=124)
    )
    assert [s.token_ids for s in other[0].samples] != [s.token_ids for s in mine.samples]


def test_generate_gives_each_prompt_its_own_streams() -> None:
    model = MODELS["llama_gqa"]()
    params = SamplingParams(max_new_tokens=8, seed=5)
    both = Engine(model, slots=8, stop_token_ids=[EOS]).generate([PROMPTS[1], PROMPTS[1]], 2, params)
    assert [s.token_ids for s in both[0].samples] != [s.token_ids for s in both[1].samples]
    first = Engine(model, slots=2, stop_token_ids=[EOS]).generate([PROMPTS[1]], 2, params)
    assert [s.token_ids for s in first[0].samples] == [s.token_ids for s in both[0].samples]


def test_cancel_frees_running_and_queued_samples() -> None:
    model = MODELS["llama_gqa"]()
    engine = Engine(model, slots=2, stop_token_ids=[])
    keep = engine.submit(PROMPTS[0], 1, SamplingParams(max_new_tokens=8, seed=0))
    dropped = engine.submit(PROMPTS[1], 1, SamplingParams(max_new_tokens=50, seed=1))
    queued = engine.submit(PROMPTS[2], 2, SamplingParams(max_new_tokens=4, seed=2))
    for _ in range(3):
        engine.step()
    engine.cancel(dropped)
    events = engine.step()
    assert [(e.sample.request.id, e.finish_reason) for e in events if e.finish_reason] == [
        (dropped.id, "cancelled")
    ]
    assert len(dropped.samples[0].token_ids) == 3
    assert len(queued.samples[0].token_ids) == 1  # the freed slot took a queued sample in that step
    engine.cancel(queued)
    while not engine.idle:
        engine.step()
    assert [s.finish_reason for s in queued.samples] == ["cancelled", "cancelled"]
    assert len(queued.samples[0].token_ids) == 1 and queued.samples[1].token_ids == []
    assert keep.samples[0].finish_reason == "length" and len(keep.samples[0].token_ids) == 8
    _assert_exact(model, [keep])


def test_stop_tokens_end_a_sample_and_are_kept() -> None:
    model = MODELS["llama_gqa"]()
    stops = tuple(range(3, VOCAB, 4))  # a quarter of the vocabulary: most samples stop early
    engine = Engine(model, slots=4, stop_token_ids=[EOS])
    (request,) = engine.generate([PROMPTS[0]], 8, SamplingParams(max_new_tokens=30, stop_token_ids=stops))
    stopped = 0
    for sample in request.samples:
        *body, last = sample.token_ids
        assert not any(t in stops or t == EOS for t in body)
        if sample.finish_reason == "stop":
            assert last in stops or last == EOS
            stopped += 1
        else:
            assert sample.finish_reason == "length" and len(sample.token_ids) == 30
    assert stopped >= 6


def test_greedy_is_the_argmax_of_the_full_forward() -> None:
    model = MODELS["sliding_window"]()
    engine = Engine(model, slots=2, stop_token_ids=[])
    requests = engine.generate(PROMPTS[:3], 1, SamplingParams(max_new_tokens=10, greedy=True))
    for request in requests:
        ids = list(request.prompt_ids)
        for _ in range(10):
            with torch.no_grad():
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        assert request.samples[0].token_ids == ids[len(request.prompt_ids) :]
    _assert_exact(model, requests)


def test_a_hook_on_the_head_changes_the_logits_it_draws_from() -> None:
    """Benchmarks bar tokens with a forward hook on the LM head; the engine's head honours it."""
    model = MODELS["llama_gqa"]()
    allowed = torch.tensor([7, 11, 13])
    barred = torch.ones(VOCAB, dtype=torch.bool).index_fill_(0, allowed, False)
    model.lm_head.register_forward_hook(lambda m, args, out: out.masked_fill(barred, float("-inf")))
    (request,) = Engine(model, slots=4).generate([PROMPTS[0]], 4, SamplingParams(max_new_tokens=10, seed=0))
    tokens = {t for s in request.samples for t in s.token_ids}
    assert tokens <= {7, 11, 13} and len(tokens) > 1


def test_top_logprobs_are_the_most_likely_tokens() -> None:
    model = MODELS["qwen3_moe"]()
    engine = Engine(model, slots=2, stop_token_ids=[EOS])
    (request,) = engine.generate(
        [PROMPTS[2]], 2, SamplingParams(max_new_tokens=5, temperature=0.7, top_logprobs=3, seed=0)
    )
    for sample in request.samples:
        for t, top in enumerate(sample.top_logprobs):
            ids = torch.tensor([request.prompt_ids + sample.token_ids[:t]])
            with torch.no_grad():
                log_pi = torch.log_softmax(model(ids).logits[0, -1] / 0.7, -1)
            values, indices = log_pi.topk(3)
            assert [i for i, _ in top] == indices.tolist()
            # LOGPROB_ATOL (see its definition), 1/T = 1.4 times more sensitive: still ~7 sigma
            torch.testing.assert_close(torch.tensor([v for _, v in top]), values, atol=LOGPROB_ATOL, rtol=0)


def test_weights_changed_between_steps_with_a_prefix_reset() -> None:
    """A sample admitted after the weights changed is computed with the new weights once the queued
    prompts are reset (it would otherwise start from the old prompt's keys and values)."""
    model = MODELS["llama_gqa"]()
    engine = Engine(model, slots=1, stop_token_ids=[])
    request = engine.submit(PROMPTS[0], 2, SamplingParams(max_new_tokens=4, seed=0))
    for _ in range(3):
        engine.step()
    assert len(request.samples[0].token_ids) == 3 and request.samples[1].token_ids == []
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    engine.reset_prefix_cache()
    while not engine.idle:
        engine.step()
    got = torch.tensor(request.samples[1].logprobs)
    # LOGPROB_ATOL: see its definition (the old prompt's keys and values would move log pi by ~1)
    torch.testing.assert_close(got, _recomputed(model, request)[1], atol=LOGPROB_ATOL, rtol=0)


def test_submit_refuses_what_the_model_cannot_take() -> None:
    engine = Engine(MODELS["llama_gqa"](), slots=2, max_length=12)
    params = SamplingParams(max_new_tokens=4)
    for prompt, n, error in [
        ([], 1, "empty"),
        ([5, VOCAB], 1, "vocabulary"),
        ([-1, 5], 1, "vocabulary"),
        (list(range(3, 15)), 1, "limit is 12"),
        ([5], 0, "at least one"),
    ]:
        with pytest.raises(ValueError, match=error):
            engine.submit(prompt, n, params)
    assert engine.idle
    (request,) = engine.generate([list(range(3, 13))], 1, SamplingParams(max_new_tokens=10))
    assert len(request.samples[0].token_ids) == 2 and request.samples[0].finish_reason == "length"
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(max_new_tokens=4, temperature=0.0)


def test_a_waiting_driver_wakes_when_work_arrives() -> None:
    model = MODELS["llama_gqa"]()
    engine = Engine(model, slots=2)
    assert engine.wait(timeout=0.01) is False and engine.load == (0, 0)
    timer = threading.Timer(0.05, lambda: engine.submit(PROMPTS[1], 3, SamplingParams(max_new_tokens=2)))
    start = time.perf_counter()
    timer.start()
    assert engine.wait(timeout=30) is True
    assert time.perf_counter() - start < 20  # woken by the submit, not by the timeout
    assert engine.load == (0, 3)
    engine.step()
    assert engine.load == (2, 1)
    timer.join()


def test_submit_from_another_thread_joins_the_running_batch() -> None:
    model = MODELS["llama_gqa"]()
    engine = Engine(model, slots=4, stop_token_ids=[])
    first = engine.submit(PROMPTS[0], 1, SamplingParams(max_new_tokens=12, seed=0))
    engine.step()
    submitted = []
    thread = threading.Thread(
        target=lambda: submitted.append(engine.submit(PROMPTS[1], 2, SamplingParams(max_new_tokens=3)))
    )
    thread.start()
    thread.join()
    events = engine.step()
    assert sorted(e.sample.request.id for e in events) == [first.id, submitted[0].id, submitted[0].id]
    while not engine.idle:
        engine.step()
    _assert_exact(model, [first, submitted[0]])


def _naive_draw(probs: list[float], u: float, top_p: float) -> int:
    """A token from probs by the inverse CDF in ascending order within transformers' top-p nucleus."""
    order = sorted(range(len(probs)), key=lambda i: probs[i])
    kept, mass = [], 0.0
    for rank, i in enumerate(order):
        mass += probs[i]
        if mass > 1 - top_p or rank == len(order) - 1:
            kept.append(i)
    total = sum(probs[i] for i in kept)
    cumulative = 0.0
    for i in kept:
        cumulative += probs[i] / total
        if u <= cumulative:
            return i
    return kept[-1]


def test_draw_matches_a_naive_nucleus_sampler() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(200, 12, generator=gen) * 2
    top_p = [0.3, 0.8, 1.0, 0.95] * 50
    rows = [Row(uniform(stream_key(7, i), 0), 0.8, top_p[i]) for i in range(200)]
    draws = draw(logits.clone(), rows)  # draw works in place
    probs = torch.softmax(logits / 0.8, -1)
    agree = 0
    for i, row in enumerate(rows):
        u = torch.tensor(row.uniform, dtype=torch.float32)
        want = _naive_draw(probs[i].tolist(), float(u), row.top_p)
        if row.top_p == 1.0:  # no nucleus: the inverse CDF in vocabulary order
            want = int(torch.searchsorted(probs[i].cumsum(0), u * probs[i].sum()))
        agree += int(draws.tokens[i]) == want
    assert agree >= 198  # rounding may move a draw that falls on a boundary
    torch.testing.assert_close(
        draws.logprobs, torch.log_softmax(logits / 0.8, -1).gather(1, draws.tokens[:, None])[:, 0]
    )
    greedy = draw(logits.clone(), [Row(0.5, 0.8, 0.3, greedy=True)] * 200)
    assert torch.equal(greedy.tokens, logits.argmax(-1))
    torch.testing.assert_close(greedy.logprobs, torch.log_softmax(logits, -1).max(-1).values)


def test_the_inverse_cdf_draws_each_token_in_proportion_and_never_a_barred_one() -> None:
    probs = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.125, 0.125, 0.0])
    grid = (torch.arange(4096, dtype=torch.float32) + 1) / 4096  # evenly spread uniforms in (0, 1]
    tokens = draw(probs.log().repeat(4096, 1), [Row(float(u)) for u in grid]).tokens
    assert torch.bincount(tokens, minlength=7).tolist() == [0, 2048, 0, 1024, 512, 512, 0]


def test_the_two_level_inverse_cdf_equals_a_full_cumulative_sum() -> None:
    """Probabilities in multiples of 2^-12 sum exactly in fp32, so both searches must agree everywhere:
    700 tokens (two blocks of 256 and a partial one), the second block all zero."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.randint(0, 9, (3, 700), generator=gen).float() * 2.0**-12
    probs[:, 256:512] = 0.0
    probs[1, :256] = 0.0  # row 1: only the last block has mass
    grid = (torch.arange(1, 1001, dtype=torch.float32) / 1000).repeat_interleave(3)
    rows = probs.repeat(1000, 1)
    got = _inverse_cdf(rows, grid)
    cdf = rows.cumsum(-1)
    want = torch.searchsorted(cdf, (grid * cdf[:, -1])[:, None]).squeeze(1)
    assert torch.equal(got, want)
    assert bool((rows.gather(1, got[:, None]) > 0).all())


def test_a_row_of_nan_logits_draws_a_token_of_the_vocabulary_and_reports_nan() -> None:
    """A diverged model's NaN logits (the config fuzz: fp16 weights at lr 0.01) must not index past the
    vocabulary, under or over a block of 256 tokens: the NaN log-prob goes on to the learner, which names it
    (exit 3)."""
    for vocab in (99, 700):
        logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
        logits[1] = float("nan")
        draws = draw(logits, [Row(0.5), Row(0.5), Row(0.5, top_p=0.9)])
        assert int(draws.tokens.min()) >= 0 and int(draws.tokens.max()) < vocab
        assert torch.isnan(draws.logprobs[1]) and bool(torch.isfinite(draws.logprobs[[0, 2]]).all())


def test_the_random_streams_are_uniform_and_distinct() -> None:
    draws = torch.tensor([uniform(stream_key(0, s), t) for s in range(50) for t in range(200)])
    assert float(draws.min()) > 0 and float(draws.max()) <= 1
    counts = torch.histc(draws, bins=10, min=0, max=1)
    assert float(((counts - 1000) ** 2 / 1000).sum()) < 30  # chi-square, 9 dof: p < 1e-3 beyond this
    assert uniform(stream_key(0, 1), 5) != uniform(stream_key(0, 2), 5) != uniform(stream_key(1, 1), 5)
