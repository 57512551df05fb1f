"""gspo serve: the real server (uvicorn, 127.0.0.1) on a tiny model, driven with the official openai SDK.

Exactness: a multi-turn conversation's trained tokens are the sampled ones bit for bit, the recorded
log-probs equal the trainer's recomputation at the same version; 16 concurrent sessions; every refusal
names its field and leaves the server serving; a failed update leaves the weights as they were; a
disconnected client frees its slot; stale and wait modes tag versions; a kill -9 loses nothing acknowledged.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
import yaml

import gspo.learning.step as serve_step
import gspo.serve.generation as serve_generation
from conftest import run_example_smoke, tiny_config
from gspo.cli import main
from gspo.client import Client, Episode, EpisodeGroup, completion_id
from gspo.config import ConfigError, load_config
from gspo.core.layout import make_micro_batches
from gspo.learning.policy import score
from gspo.run.lock import LOCK_FILE, holder_if_locked
from gspo.run.resume import RUN_MARKER
from gspo.serve.chat import parse_tool_calls
from gspo.serve.server import api_key, build_service, serve_config, start_in_thread

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
QUESTION = [{"role": "user", "content": "What is 2+3?"}]


def _start(run_dir: Path, *overrides: str, key: str | None = None):
    config = tiny_config(run_dir, "serve.slots=16", *overrides)
    return start_in_thread(build_service(config, key=key))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    running = _start(tmp_path_factory.mktemp("serve") / "run")
    yield running
    running.stop()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)


def _chat(client: openai.OpenAI, messages: list, **kwargs):
    return client.chat.completions.create(model="gspo", messages=messages, max_tokens=6, **kwargs)


def _group(client: openai.OpenAI, size: int) -> list[EpisodeGroup]:
    """One group of `size` fresh one-turn trajectories with rewards 0 .. size - 1."""
    return [EpisodeGroup([Episode([completion_id(_chat(client, QUESTION))], float(r)) for r in range(size)])]


def _extra(obj) -> dict:
    return obj.model_extra


def test_models_chat_and_text_completions_carry_exact_tokens(client: openai.OpenAI, server) -> None:
    (card,) = client.models.list().data
    assert card.id == "gspo" and _extra(card)["policy_version"] == server.service.trainer.version
    reply = _chat(client, QUESTION, n=3, logprobs=True, top_logprobs=2, seed=7)
    tokenizer = server.service.inference.tokenizer
    text = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert _extra(reply)["prompt_token_ids"] == tokenizer(text, add_special_tokens=False).input_ids
    for choice in reply.choices:
        extra = _extra(choice)
        ids, lps = extra["token_ids"], extra["token_logprobs"]
        assert 1 <= len(ids) <= 6 and len(lps) == len(ids) and all(lp <= 0 for lp in lps)
        assert [t.logprob for t in choice.logprobs.content] == lps
        assert all(
            len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.logprob
            for t in choice.logprobs.content
        )
        shown = ids[:-1] if choice.finish_reason == "stop" else ids
        assert choice.message.content == tokenizer.decode(shown, skip_special_tokens=True)
        assert choice.message.completion_id == extra["completion_id"] == completion_id(reply, choice.index)
    again = _chat(client, QUESTION, n=3, seed=7)  # a seeded request repeats exactly
    assert [_extra(c)["token_ids"] for c in again.choices] == [_extra(c)["token_ids"] for c in reply.choices]
    text = client.completions.create(model="gspo", prompt=[[5, 6, 7], [8, 9]], max_tokens=4, n=2, logprobs=1)
    assert [c.index for c in text.choices] == [0, 1, 2, 3]
    assert _extra(text.choices[0])["prompt_token_ids"] == [5, 6, 7]
    assert text.choices[2].logprobs.token_logprobs == _extra(text.choices[2])["token_logprobs"]


def test_streaming_sends_the_same_tokens_as_the_answer(client: openai.OpenAI) -> None:
    whole = _chat(client, QUESTION, seed=3)
    chunks = list(_chat(client, QUESTION, seed=3, stream=True, stream_options={"include_usage": True}))
    parts = [c.choices[0] for c in chunks if c.choices]
    text = "".join(p.delta.content or "" for p in parts)
    ids = [t for p in parts for t in (_extra(p).get("token_ids") or [])]
    assert text == whole.choices[0].message.content
    assert ids == _extra(whole.choices[0])["token_ids"]
    assert parts[-1].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == len(ids)


def test_a_stop_string_ends_text_and_tokens_where_it_completes(client: openai.OpenAI, server) -> None:
    """The text stops before the first stop string, the tokens at the one that completed it (a naive
    reference: the shortest prefix whose text holds it), streamed or not; an answer without stop strings
    (its tokens handed over at its end, not per step) is the unstopped one."""
    settings = {"model": "gspo", "messages": QUESTION, "max_tokens": 16, "temperature": 0}
    free = client.chat.completions.create(**settings)
    ids = _extra(free.choices[0])["token_ids"]
    tokenizer = server.service.inference.tokenizer
    assert free.choices[0].message.content == tokenizer.decode(ids, skip_special_tokens=True)
    stop = free.choices[0].message.content[6:8]
    k = next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k], skip_special_tokens=True))
    shown = tokenizer.decode(ids[:k], skip_special_tokens=True)
    assert k < len(ids), "the stop string should end the answer early"
    whole = client.chat.completions.create(**settings, stop=[stop, "never said"])
    assert whole.choices[0].message.content == shown[: shown.index(stop)]
    assert _extra(whole.choices[0])["token_ids"] == ids[:k] and whole.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(**settings, stop=stop, stream=True))
    parts = [c.choices[0] for c in chunks if c.choices]
    assert "".join(p.delta.content or "" for p in parts) == whole.choices[0].message.content
    assert [t for p in parts for t in (_extra(p).get("token_ids") or [])] == ids[:k]
    assert parts[-1].finish_reason == "stop"


def test_async_client_and_16_concurrent_multi_turn_sessions_are_batched(server) -> None:
    client = openai.AsyncOpenAI(base_url=server.url, api_key="none", max_retries=0)
    steps_before = server.service.inference.driver.steps

    async def session(i: int) -> list:
        messages, replies = [{"role": "user", "content": f"Count to {i}."}], []
        for turn in range(3):
            reply = await client.chat.completions.create(
                model="gspo", messages=messages, max_tokens=5, seed=i
            )
            replies.append(reply)
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": f"more {turn}"},
            ]
        return replies

    async def run() -> list:
        return await asyncio.gather(*(session(i) for i in range(16)))

    sessions = asyncio.run(run())
    tokens = 0
    for replies in sessions:
        for before, after in itertools.pairwise(replies):
            # each turn's prompt starts with the previous turn's prompt and sampled tokens, verbatim
            history = _extra(before)["prompt_token_ids"] + _extra(before.choices[0])["token_ids"]
            assert _extra(after)["prompt_token_ids"][: len(history)] == history
            assert _extra(after)["unmatched_messages"] == []
        tokens += sum(len(_extra(r.choices[0])["token_ids"]) for r in replies)
    steps = server.service.inference.driver.steps - steps_before
    assert steps < tokens, f"{steps} engine steps for {tokens} tokens: the sessions were not batched"


def test_requests_that_arrive_together_decode_in_one_batch(server) -> None:
    """16 requests queued while the engine is held decode side by side: one engine step per token
    position, not one per token (the timing-free check of batching; the sessions above depend on load)."""
    driver = server.service.inference.driver
    client = openai.AsyncOpenAI(base_url=server.url, api_key="none", max_retries=0)
    asyncio.run(driver.pause(10.0))
    steps_before, tokens_before = driver.steps, driver.tokens

    async def run() -> list:
        calls = [
            asyncio.ensure_future(
                client.chat.completions.create(model="gspo", messages=QUESTION, max_tokens=5, seed=i)
            )
            for i in range(16)
        ]
        while driver.status()["waiting_samples"] < 16:
            await asyncio.sleep(0.01)
        driver.resume()
        return await asyncio.gather(*calls)

    try:
        replies = asyncio.run(run())
    finally:
        driver.resume()
    tokens = sum(len(_extra(r.choices[0])["token_ids"]) for r in replies)
    assert driver.tokens - tokens_before == tokens > 16
    assert driver.steps - steps_before <= 5, f"{driver.steps - steps_before} steps for 16 x <= 5 tokens"


def _capture_learn(monkeypatch: pytest.MonkeyPatch, seen: list, fail: bool = False) -> None:
    real = serve_step.learn

    def learn(policy, spec, batch, *, seed):
        # the trainer's own scoring of the batch, at the weights that sampled it (before any update)
        (mb,) = make_micro_batches(
            batch.sequences, layout="padded", pack_length=4096, micro_batch_tokens=1 << 20, pad_id=0
        )
        with torch.no_grad():
            logp = score(policy.model, mb, spec).reshape(mb.logprob_mask.shape)
        seen.append(
            (batch, spec, [logp[r][mb.logprob_mask[r]] for r in range(len(batch.sequences))], mb.indices)
        )
        metrics = real(policy, spec, batch, seed=seed)
        if fail:
            raise RuntimeError("injected failure after the updates")
        return metrics

    monkeypatch.setattr(serve_step, "learn", learn)


def _session(client: openai.OpenAI, seed: int, by_object: bool) -> tuple[list, list]:
    """Two turns with a tool result between them; the assistant message sent back as the SDK's object
    (its completion_id travels along) or as a plain dict (matched by prompt and text)."""
    first = _chat(client, QUESTION, seed=seed, temperature=1.0)
    message = (
        first.choices[0].message
        if by_object
        else {"role": "assistant", "content": first.choices[0].message.content}
    )
    messages = [*QUESTION, message, {"role": "tool", "content": "5"}]
    second = _chat(client, messages, seed=seed + 1, temperature=1.0)
    return [first, second], messages


def test_multi_turn_training_uses_the_sampled_tokens_bit_for_bit(client, server, monkeypatch) -> None:
    seen: list = []
    _capture_learn(monkeypatch, seen)
    sessions = [_session(client, 10 + 2 * i, by_object=i % 2 == 0) for i in range(4)]
    for replies, _ in sessions:
        assert (
            _extra(replies[1])["spliced_messages"] == [1] and _extra(replies[1])["unmatched_messages"] == []
        )
    trajectories = [
        Episode([completion_id(r) for r in replies], reward=float(i))
        for i, (replies, _) in enumerate(sessions)
    ]
    version = server.service.trainer.version
    answer = Client(server.url).train([EpisodeGroup(trajectories)])
    assert answer["version"] == version + 1 and answer["split_trajectories"] == []
    assert answer["old_logprobs"] == "sampler" and answer["metrics"]["split_trajectories"] == 0
    (batch, _, recomputed, order) = seen[0]
    for i, (replies, _) in enumerate(sessions):
        first, second = (_extra(r) for r in replies)
        c1, c2 = (_extra(r.choices[0]) for r in replies)
        sequence = batch.sequences[i]
        # the trained sequence is the last turn's prompt and completion as sampled, bit for bit
        assert sequence.prompt_ids + sequence.completion_ids == second["prompt_token_ids"] + c2["token_ids"]
        assert sequence.prompt_ids == first["prompt_token_ids"]
        gap = len(second["prompt_token_ids"]) - len(first["prompt_token_ids"]) - len(c1["token_ids"])
        assert gap > 0  # the tool turn and the template's glue
        assert sequence.train_mask == [True] * len(c1["token_ids"]) + [False] * gap + [True] * len(
            c2["token_ids"]
        )
        sampled = c1["token_logprobs"] + c2["token_logprobs"]
        trained = [lp for lp, t in zip(batch.sampler_logprobs[i], sequence.train_mask, strict=True) if t]
        assert trained == sampled
        mine = recomputed[order.index(i)][torch.tensor(sequence.train_mask)]
        # fp32, the sampler's one-row KV-cache steps against whole-sequence scoring: other GEMM shapes, so
        # other roundings, <= n*u with n ~ 1e3 along the 2-layer width-64 path (6e-5) plus ulp(5) = 5e-7;
        # another version's weights (one update) or an off-by-one token moves log-probs by >= 1e-2
        assert torch.allclose(mine, torch.tensor(sampled), atol=1e-4, rtol=0), (
            (mine - torch.tensor(sampled)).abs().max()
        )


def test_the_train_call_takes_groups_as_the_json_docs_agents_md_shows(client, server) -> None:
    """Client.train with plain mappings, {"trajectories": [{"completion_ids": [...], "reward": r}]} (an
    Episode among them too), as docs/agents.md writes a train call: it trains ('dict' object has no
    attribute 'to_json' before)."""
    ids = [completion_id(_chat(client, QUESTION, seed=seed)) for seed in (21, 22, 23)]
    version = server.service.trainer.version
    trajectories = [{"completion_ids": [ids[0]], "reward": 1.0}, Episode([ids[1]], 0.0)]
    trajectories.append({"completion_ids": [ids[2]], "reward": 0.5})
    answer = Client(server.url).train([{"trajectories": trajectories}])
    assert answer["version"] == version + 1
    with pytest.raises(
        TypeError, match=r"a group is an EpisodeGroup or a mapping \{'trajectories': \[...\]\}, got list"
    ):
        Client(server.url).train([[Episode([ids[0]], 1.0)]])


def test_a_rewritten_history_is_trained_as_exact_segments_and_reported(client, server, monkeypatch) -> None:
    seen: list = []
    _capture_learn(monkeypatch, seen)
    first = _chat(client, QUESTION, seed=1)
    # the agent rewrites its own earlier answer: turn 2's prompt no longer extends turn 1's tokens
    edited = [*QUESTION, {"role": "assistant", "content": "five"}, {"role": "user", "content": "sure?"}]
    second = _chat(client, edited, seed=2)
    assert _extra(second)["unmatched_messages"] == [1]
    other = _chat(client, QUESTION, seed=3)
    groups = [
        EpisodeGroup(
            [
                Episode([completion_id(first), completion_id(second)], 1.0),
                Episode([completion_id(other)], 0.0),
            ]
        )
    ]
    answer = Client(server.url).train(groups)
    (split,) = answer["split_trajectories"]
    assert split["group"] == 0 and split["trajectory"] == 0 and split["segments"] == 2
    assert "turn 1's prompt does not start with turn 0's" in split["breaks"][0]
    batch = seen[0][0]
    assert len(batch.sequences) == 3 and answer["metrics"]["split_trajectories"] == 1
    assert batch.sequences[1].prompt_ids == _extra(second)["prompt_token_ids"]
    assert batch.sequences[1].completion_ids == _extra(second.choices[0])["token_ids"]
    assert float(batch.advantages[0]) == float(batch.advantages[1]) > 0 > float(batch.advantages[2])


def _error(call) -> tuple[int, dict]:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    return info.value.status_code, info.value.body


def test_bad_requests_get_a_4xx_naming_the_field_and_nothing_else_is_disturbed(client, server) -> None:
    good = _chat(client, QUESTION)
    cases = {
        "n": lambda: _chat(client, QUESTION, n=17),
        "max_tokens": lambda: client.chat.completions.create(model="gspo", messages=QUESTION, max_tokens=513),
        "messages[0].role": lambda: _chat(client, [{"role": "robot", "content": "hi"}]),
        "model": lambda: client.chat.completions.create(model="gpt-4", messages=QUESTION),
        "frequency_penalty": lambda: _chat(client, QUESTION, frequency_penalty=0.5),
        "tools": lambda: _chat(client, QUESTION, tools=[{"type": "function", "function": {"name": "f"}}]),
        "prompt": lambda: client.completions.create(model="gspo", prompt=[[1, 10**6]], max_tokens=2),
        "surprise": lambda: _chat(client, QUESTION, extra_body={"surprise": 1}),
    }
    for field, call in cases.items():
        status, body = _error(call)
        assert 400 <= status < 500, (field, status, body)
        assert body["param"] == field, (field, body)
    # a penalty is refused for what it does, not as out of a range ("less than or equal to 0")
    _, body = _error(cases["frequency_penalty"])
    assert body["message"] == (
        "frequency_penalty: a frequency penalty changes the distribution the trainer scores, so gspo serve "
        "samples without one: leave it out (or send 0)"
    )
    assert _chat(client, QUESTION, frequency_penalty=0.0, presence_penalty=0.0).choices
    json_mode = _error(lambda: _chat(client, QUESTION, response_format={"type": "json_object"}))[1]
    assert (
        json_mode["param"] == "response_format"
        and "JSON mode and schemas constrain the sampling" in (json_mode["message"])
    )
    assert _chat(client, QUESTION, response_format={"type": "text"}).choices
    # a forced tool call: a bare "Input should be 'none' or 'auto'" before; now the reason and what to send
    for forced in ("required", {"type": "function", "function": {"name": "f"}}):
        status, body = _error(lambda forced=forced: _chat(client, QUESTION, tool_choice=forced))
        assert status == 400 and body["param"] == "tool_choice", body
        assert "forces a tool call, which constrains the sampling" in body["message"]
        assert "send tool_choice='auto'" in body["message"]
    # the context window: a prompt near 512 tokens with room for fewer than max_tokens
    status, body = _error(lambda: client.completions.create(model="gspo", prompt=[[5] * 508], max_tokens=8))
    assert status == 400 and body["code"] == "context_length_exceeded" and body["param"] == "max_tokens"
    raw = httpx.post(
        server.url + "/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "body"

    def post(path: str, body: dict) -> httpx.Response:  # raw JSON: the SDK refuses to send NaN
        return httpx.post(
            server.url + path, content=json.dumps(body), headers={"content-type": "application/json"}
        )

    nan = {"model": "gspo", "messages": QUESTION, "temperature": float("nan")}
    assert post("/chat/completions", nan).json()["error"]["param"] == "temperature"
    trains = {
        "groups[0].trajectories[0].completion_ids[0]": {
            "groups": [{"trajectories": [{"completion_ids": ["gspo-nope"], "reward": 1}]}]
        },
        "groups[0].trajectories[0].reward": {
            "groups": [{"trajectories": [{"completion_ids": [completion_id(good)], "reward": float("nan")}]}]
        },
        "groups[0].trajectories[0].turn_rewards": {
            "groups": [
                {
                    "trajectories": [
                        {"completion_ids": [completion_id(good)], "reward": 1, "turn_rewards": [1, 2]}
                    ]
                }
            ]
        },
        "groups": {"groups": []},
    }
    version = server.service.trainer.version
    for field, body in trains.items():
        response = post("/train", body)
        assert 400 <= response.status_code < 500 and response.json()["error"]["param"] == field, (
            field,
            response.text,
        )
    assert server.service.trainer.version == version
    assert _chat(client, QUESTION, n=2).choices[1].finish_reason in ("stop", "length")  # still serving


def test_a_failed_update_leaves_weights_optimizer_and_version_as_they_were(tmp_path, monkeypatch) -> None:
    running = _start(tmp_path / "run")
    try:
        client = openai.OpenAI(base_url=running.url, api_key="none", max_retries=0)
        trainer = running.service.trainer
        Client(running.url).train(_group(client, 3))  # the optimizer has state now
        before = {k: v.clone() for k, v in trainer.policy.model.state_dict().items()}
        state = {
            k: v.clone() for s in trainer.policy.optimizer.state.values() for k, v in s.items() if k != "step"
        }
        lr = trainer.policy.scheduler.get_last_lr()
        seen: list = []
        _capture_learn(monkeypatch, seen, fail=True)
        status, body = _error(lambda: Client(running.url).train(_group(client, 3)))
        assert (
            status == 500
            and body["code"] == "update_failed"
            and "as they were (policy version 1)" in body["message"]
        )
        after = trainer.policy.model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert trainer.version == 1 and trainer.policy.scheduler.get_last_lr() == lr
        kept = {k: v for s in trainer.policy.optimizer.state.values() for k, v in s.items() if k != "step"}
        assert all(torch.equal(state[k], kept[k]) for k in state)
        monkeypatch.undo()
        assert Client(running.url).train(_group(client, 3))["version"] == 2
    finally:
        running.stop()


def test_a_client_that_disconnects_frees_its_slot(tmp_path, monkeypatch) -> None:
    """Greedy on the fresh tiny model runs all 480 tokens: a client that leaves after the first chunk, or
    gives up waiting for a whole answer, has its request cancelled before it ends, and the engine stops
    decoding it at once. Each engine step is slowed to at least 10 ms, so the 480 tokens take at least
    4.8 s on any machine (on a fast idle one they once ended before the disconnect was seen). Counted from
    the tokens decoded when the disconnect was seen, not from the start: how many tokens a poll interval
    holds depends on the machine's load."""
    monkeypatch.setattr(serve_generation, "DISCONNECT_CHECK", 0.05)  # poll often: the test's seconds
    running = _start(tmp_path / "run")
    try:
        driver = running.service.inference.driver
        real_step = driver.engine.step
        monkeypatch.setattr(driver.engine, "step", lambda: (time.sleep(0.01), real_step())[1])
        seen: list[int] = []  # driver.tokens at each cancel
        real_cancel = driver.cancel
        monkeypatch.setattr(
            driver, "cancel", lambda handle: (seen.append(driver.tokens), real_cancel(handle))
        )
        body = {"model": "gspo", "messages": QUESTION, "max_tokens": 480, "temperature": 0, "stream": True}
        for stream, timeout in ((True, 30.0), (False, 0.3)):
            tokens, cancels = driver.tokens, len(seen)
            if stream:
                with httpx.stream(
                    "POST", running.url + "/chat/completions", json=body, timeout=timeout
                ) as response:
                    next(response.iter_lines())
            else:
                with pytest.raises(httpx.ReadTimeout):
                    httpx.post(
                        running.url + "/chat/completions", json=body | {"stream": False}, timeout=timeout
                    )
            # a stream's first chunk comes before the request has a slot: wait for the cancel too
            deadline = time.monotonic() + 30.0
            while (
                driver.status()["running_samples"] or len(seen) == cancels
            ) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert driver.status()["running_samples"] == 0, "the request kept its slot"
            assert len(seen) == cancels + 1, "the disconnect did not cancel the request"
            assert seen[-1] - tokens < 480, "the request ran to its end before the disconnect was seen"
            # the step running when it was cancelled may still deliver its token; no later step decodes it
            assert driver.tokens - seen[-1] <= 1, "the cancelled request kept decoding"
        assert driver.status()["errors"] == 0, driver.status()["last_error"]
        client = openai.OpenAI(base_url=running.url, api_key="none", max_retries=0)
        assert len(_extra(_chat(client, QUESTION, temperature=0).choices[0])["token_ids"]) == 6
    finally:
        running.stop()


def test_wait_mode_holds_requests_during_an_update_and_stale_mode_serves_them(tmp_path, monkeypatch) -> None:
    real = serve_step.learn

    def slow_learn(*args, **kwargs):
        time.sleep(1.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(serve_step, "learn", slow_learn)
    for mode, version_during, lora in (("wait", 1, 0), ("stale", 0, 4)):
        running = _start(tmp_path / mode, f"serve.during_update={mode}", f"lora.rank={lora}")
        try:
            client = openai.OpenAI(base_url=running.url, api_key="none", max_retries=0)
            group = [
                EpisodeGroup([Episode([completion_id(_chat(client, QUESTION))], float(r)) for r in range(2)])
            ]
            old = _chat(client, QUESTION)
            trainer = threading.Thread(target=Client(running.url).train, args=(group,))
            trainer.start()
            time.sleep(0.5)  # the update is running
            during = _chat(client, QUESTION)
            trainer.join()
            assert _extra(during.choices[0])["policy_version"] == version_during, mode
            trainer = running.service.trainer  # stale: the sampling copy took the new (LoRA) weights
            pairs = zip(trainer.policy.model.parameters(), trainer.side.model.parameters(), strict=True)
            assert all(torch.equal(a, b) for a, b in pairs)
            assert (trainer.side.model is trainer.policy.model) == (mode == "wait")
            assert _extra(_chat(client, QUESTION).choices[0])["policy_version"] == 1
            # a completion of version 0 trains at version 1 (max_staleness 1), recomputing the old policy
            fresh = _chat(client, QUESTION)
            answer = Client(running.url).train(
                [EpisodeGroup([Episode([completion_id(old)], 1.0), Episode([completion_id(fresh)], 0.0)])]
            )
            assert answer["old_logprobs"] == "recompute" and answer["metrics"]["staleness_max"] == 1
        finally:
            running.stop()


def test_completions_older_than_max_staleness_are_refused(tmp_path) -> None:
    running = _start(tmp_path / "run", "serve.max_staleness=0")
    try:
        client = openai.OpenAI(base_url=running.url, api_key="none", max_retries=0)
        old = [completion_id(_chat(client, QUESTION)) for _ in range(3)]
        Client(running.url).train([EpisodeGroup([Episode([old[0]], 1.0), Episode([old[1]], 0.0)])])
        status, body = _error(lambda: Client(running.url).train([EpisodeGroup([Episode([old[2]], 1.0)])]))
        assert status == 400 and body["code"] == "stale_completion"
        assert (
            body["param"] == "groups[0].trajectories[0].completion_ids[0]"
            and "policy version 0" in body["message"]
        )
    finally:
        running.stop()


def test_a_repeated_request_id_is_applied_once(client, server) -> None:
    api = Client(server.url)
    group = [EpisodeGroup([Episode([completion_id(_chat(client, QUESTION))], float(r)) for r in range(2)])]
    first = api.train(group, request_id="call-1")
    again = api.train(group, request_id="call-1")
    assert again["version"] == first["version"] == server.service.trainer.version and again["repeated"]


def test_a_train_calls_completions_are_kept_in_the_run_folder(client, server) -> None:
    """gspo serve logs the completions a train call trains as gspo train logs its rollouts: one line each
    in RUN/completions.jsonl, at the step (policy version) they trained, with their trajectory's reward."""
    replies = [_chat(client, QUESTION) for _ in range(2)]
    episodes = [Episode([completion_id(r)], float(i)) for i, r in enumerate(replies)]
    version = Client(server.url).train([EpisodeGroup(episodes)])["version"]
    lines = (server.service.trainer.run_dir / "completions.jsonl").read_text().splitlines()
    rows = [row for row in map(json.loads, lines) if row["step"] == version]
    assert [(r["completion"], r["reward"]) for r in rows] == [
        (reply.choices[0].message.content, float(i)) for i, reply in enumerate(replies)
    ]
    prompt = server.service.inference.tokenizer.decode(_extra(replies[0])["prompt_token_ids"])
    assert rows[0]["prompt"] == prompt and "What is 2+3?" in prompt


def test_client_gather_runs_the_rollout_g_times_per_scenario(server) -> None:
    api = Client(server.url)

    async def rollout(agent: openai.AsyncOpenAI, scenario: int) -> Episode:
        trajectory = Episode()
        reply = await agent.chat.completions.create(
            model=api.model, messages=[{"role": "user", "content": str(scenario)}], max_tokens=3
        )
        trajectory.add(reply)
        trajectory.reward = float(len(reply.choices[0].message.content))
        if scenario == 2:
            raise ValueError("an episode that fails")
        return trajectory

    groups = asyncio.run(api.gather(rollout, [0, 1, 2], group_size=4, max_exceptions=4))
    assert [len(g.trajectories) for g in groups] == [4, 4]
    with pytest.raises(ValueError, match="fails"):
        asyncio.run(api.gather(rollout, [2], group_size=2))
    assert api.train(groups)["metrics"]["trajectories"] == 8


def test_an_api_key_is_required_checked_and_never_logged(tmp_path, caplog) -> None:
    key = "sk-test-" + "s3cr3t" * 4
    caplog.set_level(logging.DEBUG)
    running = _start(tmp_path / "run", key=key)
    try:
        assert httpx.get(running.url.removesuffix("/v1") + "/health").status_code == 200
        status, body = _error(
            lambda: openai.OpenAI(base_url=running.url, api_key="wrong", max_retries=0).models.list()
        )
        assert status == 401 and key not in str(body)
        assert httpx.get(running.url + "/models").status_code == 401
        good = openai.OpenAI(base_url=running.url, api_key=key, max_retries=0)
        assert good.models.list().data[0].id == "gspo"
        assert key not in repr(running.service)
    finally:
        running.stop()
    assert key not in caplog.text


def test_listening_beyond_loopback_needs_a_key_and_resume_never_takes_it_from_the_run_folder(
    tmp_path, monkeypatch
) -> None:
    with pytest.raises(ConfigError, match=r"serve\.api_key_env"):
        load_config(None, ["serve.host=0.0.0.0"])
    assert main(["serve", "serve.host=0.0.0.0"]) == 3
    monkeypatch.delenv("GSPO_TEST_KEY", raising=False)
    assert main(["serve", "serve.api_key_env=GSPO_TEST_KEY", f"output_dir={tmp_path / 'x'}"]) == 3
    run = tmp_path / "shared"
    run.mkdir()
    (run / RUN_MARKER).write_text("")
    (run / "config.yaml").write_text("serve:\n  host: 0.0.0.0\n  api_key_env: GITHUB_TOKEN\n  port: 9999\n")
    config = serve_config(None, [], run)
    assert (config.serve.host, config.serve.api_key_env, config.serve.port) == ("127.0.0.1", None, 8000)
    config = serve_config(None, ["serve.port=0", "serve.slots=4"], run)
    assert config.serve.port == 0 and config.serve.slots == 4


def test_tool_calls_are_parsed_from_hermes_blocks() -> None:
    content, calls = parse_tool_calls(
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'
    )
    assert content == "Let me add." and calls[0]["function"] == {"name": "add", "arguments": '{"a": 2}'}
    assert parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])


def _serve_process(*args: str, cwd: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    log = open(cwd / "server.log", "a")  # noqa: SIM115 (the server's stderr; closed with the process)
    command = [sys.executable, "-m", "gspo", "serve", *args]
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    line = process.stdout.readline()
    if not line.startswith("gspo serve: http://"):
        process.kill()
        pytest.fail(f"gspo serve did not start: {line}{(cwd / 'server.log').read_text()[-2000:]}")
    return process, line.split()[2]


@pytest.mark.slow
def test_kill_9_during_a_train_call_then_resume_loses_nothing_acknowledged(tmp_path: Path) -> None:
    run = tmp_path / "run"
    process, url = _serve_process(
        str(TINY), f"output_dir={run}", "serve.port=0", "report_to=[]", cwd=tmp_path
    )
    try:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        assert Client(url).train(_group(client, 4))["version"] == 1  # acknowledged
        # one process per run folder: a second server on it is refused before it loads or writes anything
        assert main(["serve", "--resume", str(run), "serve.port=0"]) == 5
        probe = _chat(client, QUESTION, temperature=0)
        second = _group(client, 4)
        answers: list = []
        caller = threading.Thread(target=lambda: answers.append(Client(url).train(second)), daemon=True)
        caller.start()
        time.sleep(0.05)
        process.kill()  # SIGKILL, mid-call or just after
        process.wait(30)
        caller.join(30)
    finally:
        process.kill()
    # the lock's record is rewritten; metrics (and completions, rolled back alike): below
    skip = (LOCK_FILE, "metrics.jsonl", "completions.jsonl")
    kept = {path: path.stat().st_size for path in run.rglob("*") if path.is_file() and path.name not in skip}
    logged = (run / "metrics.jsonl").read_text().splitlines()
    process, url = _serve_process("--resume", str(run), "serve.port=0", cwd=tmp_path)
    try:
        # a resume deletes nothing and truncates nothing (a half-written checkpoint included)
        lost = [str(p) for p, size in kept.items() if not p.is_file() or p.stat().st_size < size]
        assert lost == [], lost
        # the unacknowledged step's metrics line, if any, is rolled back into a file of its own, not lost
        now = (run / "metrics.jsonl").read_text().splitlines()
        rolled = run / "metrics.rolled_back.jsonl"
        now += rolled.read_text().splitlines() if rolled.exists() else []
        assert set(logged) <= set(now)
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        version = Client(url).status()["trainer"]["version"]
        assert version == (2 if answers and "version" in answers[0] else version) and version >= 1
        if version == 1:  # the acknowledged step, bit for bit: the same greedy tokens and log-probs
            again = _chat(client, QUESTION, temperature=0)
            assert _extra(again.choices[0])["token_logprobs"] == _extra(probe.choices[0])["token_logprobs"]
        assert not math.isnan(Client(url).train(_group(client, 4))["metrics"]["loss"])
    finally:
        process.terminate()
        process.wait(30)
    # dozens of requests, and no access line each (serve.access_log=false): the client's output stays its own
    log = (tmp_path / "server.log").read_text()
    assert "POST /v1/chat/completions" not in log and "POST /v1/train" not in log, log[-2000:]


def test_chat_prompts_splice_the_recorded_tokens_not_a_retokenisation() -> None:
    """A completion whose tokens the text does not spell (a special token, skipped in the content): the
    next prompt holds the sampled ids, found by prompt and text or by completion_id."""
    from gspo.models import tiny_tokenizer
    from gspo.serve.chat import render_chat
    from gspo.serve.protocol import Message
    from gspo.serve.records import Record, RecordStore, float_array, token_array

    tokenizer = tiny_tokenizer()
    store = RecordStore(10, 60.0)
    prompt = render_chat(tokenizer, [Message(role="user", content="hi")], None, store).ids
    sampled = [
        *tokenizer("ab", add_special_tokens=False).input_ids[:1],
        0,
        *tokenizer("b", add_special_tokens=False).input_ids,
    ]
    content = tokenizer.decode(sampled, skip_special_tokens=True)
    assert content == "ab" and tokenizer(content, add_special_tokens=False).input_ids != sampled
    record = Record(
        "gspo-1",
        token_array(prompt),
        token_array(sampled),
        float_array([-1.0] * 3),
        (0, 0),
        1.0,
        False,
        content,
        "length",
    )
    store.add(record)
    for message in ({"content": "ab"}, {"content": "ab", "completion_id": "gspo-1"}):
        messages = [
            Message(role="user", content="hi"),
            Message(role="assistant", **message),
            Message(role="user", content="ok"),
        ]
        chat = render_chat(tokenizer, messages, None, store)
        assert (
            chat.ids[: len(prompt) + 3] == prompt + sampled and chat.spliced == [1] and chat.unmatched == []
        )
        # cut off before its end-of-turn token: the template's one follows as context
        assert chat.ids[len(prompt) + 3] == tokenizer.eos_token_id
    other = [
        Message(role="user", content="hi"),
        Message(role="assistant", content="abc"),
        Message(role="user", content="ok"),
    ]
    assert render_chat(tokenizer, other, None, store).unmatched == [1]


def test_a_conversation_the_template_cannot_render_stably_is_served_from_its_text(client) -> None:
    """The tiny tokenizer reads a blank line as one unknown token, so an answer that starts with a newline
    renders differently once the next turn follows: the prompt is then the template's, all unmatched."""
    messages = [*QUESTION, {"role": "assistant", "content": "\nfive"}, {"role": "user", "content": "sure?"}]
    reply = _chat(client, messages)
    assert _extra(reply)["unmatched_messages"] == [1] and _extra(reply)["spliced_messages"] == []


def test_gspo_serve_exit_codes_follow_the_table(tmp_path) -> None:
    (tmp_path / "file").write_text("not a folder")
    assert main(["serve", str(TINY), f"output_dir={tmp_path / 'file'}", "serve.port=0"]) == 5  # run folder
    assert main(["serve", str(TINY), "serve.max_n=0"]) == 3  # config
    assert main(["serve", "--force"]) == 2  # usage


def test_records_are_bounded_and_expire(monkeypatch) -> None:
    import gspo.serve.records as records
    from gspo.serve.records import Record, RecordStore, float_array, token_array

    now = [100.0]
    monkeypatch.setattr(records.time, "monotonic", lambda: now[0])
    store = RecordStore(max_records=3, ttl=10.0)

    def add(i: int) -> None:
        store.add(
            Record(
                f"r{i}",
                token_array([1, i]),
                token_array([i]),
                float_array([-1.0]),
                (0, 0),
                1.0,
                False,
                str(i),
                "stop",
            )
        )

    for i in range(4):
        add(i)
    assert store.get("r0") is None and store.get("r1") is not None and len(store) == 3  # the oldest went
    assert store.match([1, 1], "1").id == "r1" and store.match([1, 0], "0") is None
    now[0] += 10.5
    add(9)
    assert len(store) == 1 and store.get("r3") is None and store.expired == 4


@pytest.mark.slow
def test_the_agent_guess_example_has_a_smoke_mode(tmp_path: Path) -> None:
    """`examples/agent_guess/train.py --smoke`, like the other examples: its own `gspo serve` of the tiny
    random model, one step of two games, the held-out games measured before and after (about 30 s here)."""
    run_example_smoke("agent_guess", tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    assert [e["step"] for e in results["evals"]] == [0, 1] and [t["step"] for t in results["train"]] == [1]
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"]["tiny"] == "llama"


def test_the_servers_own_key_is_refused_at_start_by_its_variables_name_when_no_client_could_send_it(
    tmp_path, monkeypatch
) -> None:
    """The server started with keys a client cannot send (401 or 400 forever) or sends stripped; a
    client's key has been refused this way since the round before. A real `gspo serve` process first (a
    server that takes the key would serve on, and the wait below would fail), then the other keys."""
    secret = "sk-serve-SECRET0123"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(ROOT / "src"),
        "GSPO_TEST_KEY": secret + "\r",
    }
    argv = ["serve", "serve.api_key_env=GSPO_TEST_KEY", "serve.port=0", f"output_dir={tmp_path / 'run'}"]
    result = subprocess.run(
        [sys.executable, "-m", "gspo", *argv], env=env, capture_output=True, text=True, timeout=120
    )
    assert (result.returncode, result.stderr.count("\n")) == (3, 1), result.stderr
    assert result.stderr.startswith(
        "error: the environment variable GSPO_TEST_KEY (serve.api_key_env) holds whitespace, control or "
        "non-ASCII characters (a bearer token is printable ASCII); it is not shown"
    )
    assert "SECRET" not in result.stdout + result.stderr and not (tmp_path / "run").exists()
    for key in [f"{secret}é", "sk-serve\rSECRET", f"sk serve {secret}", f"{secret}\x07", f" {secret}"]:
        monkeypatch.setenv("GSPO_TEST_KEY", key)
        with pytest.raises(
            ConfigError, match=r"^the environment variable GSPO_TEST_KEY \(serve\.api_key_env\)"
        ) as error:
            api_key(load_config(None, ["serve.api_key_env=GSPO_TEST_KEY"]))
        assert "SECRET" not in str(error.value)


def test_sigterm_stops_the_server_cleanly_and_releases_its_lock(tmp_path: Path) -> None:
    """uvicorn raised SIGTERM again after its graceful shutdown, which killed the process before it released
    its lock: the next start said that the holder "ended without releasing it (killed?)"."""
    run = tmp_path / "run"
    process, url = _serve_process(
        str(TINY), f"output_dir={run}", "serve.port=0", "report_to=[]", cwd=tmp_path
    )
    try:
        assert httpx.get(url.removesuffix("/v1") + "/health").status_code == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0, (tmp_path / "server.log").read_text()[-2000:]
    finally:
        process.kill()
    assert (run / LOCK_FILE).read_bytes() == b""  # released: no holder's record left behind
    assert holder_if_locked(run) is None


def test_a_lone_surrogate_is_a_400_naming_the_field_not_the_tokenizers_internal_error(server) -> None:
    """json.loads reads "\\ud800" as a lone surrogate, which the tokenizer refused with "TextEncodeInput must
    be Union[TextInputSequence, ...]", under "the chat template cannot render them"."""
    for path, body, field in [
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": "2+\ud8003"}]},
            "messages[0].content",
        ),
        ("/completions", {"prompt": ["ok", "2+\udc00"]}, "prompt"),
    ]:
        text = json.dumps({"model": "gspo", "max_tokens": 2, **body})  # ASCII, the surrogate as "\ud800"
        response = httpx.post(
            server.url + path, content=text, headers={"Content-Type": "application/json"}, timeout=60
        )
        error = response.json()["error"]
        assert (response.status_code, error["param"]) == (400, field), error
        assert "holds a lone surrogate (U+D" in error["message"] and "TextEncodeInput" not in error["message"]
