"""`gspo serve` side by side: sampling throughput with 1 and with N concurrent chat sessions, and a train call
against `gspo train`'s update phase on the same samples, with the checkpoint that makes it durable apart.

Throughput: the real server (uvicorn in this process, 127.0.0.1) and the official openai SDK. A session is
a conversation of --turns turns, each a chat completion of up to --tokens tokens at temperature 1 (its own
seed); its assistant answers are sent back as the agent would. Tokens/s counts completion tokens over the
wall time of all sessions; 1 session and N sessions run alternately, --rounds times (medians).

Train call: N sessions' turns become trajectory groups (groups of 4, rewards 0..3) and go to POST
/v1/train with serve.durable=false; the server's own learner call is captured, and `make_batch` + `learn`
(the update phase of `gspo train`'s step, gspo.training.trainer.Trainer._learn) run on the same samples,
the same spec and seed, on a copy of the policy taken before the call. The two alternate over --rounds
calls. The checkpoint that serve.durable=true adds before each answer is timed on its own
(POST /v1/checkpoint: the same atomic save).

Run:  HF_HUB_OFFLINE=1 python benchmarks/serve.py [--tiny] [--sessions 16] [--turns 3] [--tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import platform
import statistics
import subprocess
import tempfile
import time
import warnings

import openai
import torch

import gspo.learning.step as serve_step
from gspo.client import Client, Episode, EpisodeGroup, completion_id
from gspo.config import load_config
from gspo.learning.batch import make_batch
from gspo.learning.learner import learn
from gspo.serve.server import build_service, start_in_thread

TOPICS = ["rivers", "bread", "chess", "volcanoes", "owls", "tea", "bridges", "comets"]


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(
            line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")
        )
    except (OSError, StopIteration, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"


async def session(client: openai.AsyncOpenAI, i: int, turns: int, tokens: int) -> list:
    """One conversation; returns its turns' answers."""
    messages: list = [{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}."}]
    replies = []
    for turn in range(turns):
        reply = await client.chat.completions.create(
            model="gspo", messages=messages, max_tokens=tokens, temperature=1.0, seed=1000 * i + turn
        )
        replies.append(reply)
        messages += [reply.choices[0].message, {"role": "user", "content": "Go on."}]
    return replies


async def sessions(url: str, count: int, turns: int, tokens: int) -> tuple[float, int, list]:
    """(seconds, completion tokens, replies per session) of `count` concurrent sessions."""
    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=3600)
    t0 = time.perf_counter()
    replies = await asyncio.gather(*(session(client, i, turns, tokens) for i in range(count)))
    seconds = time.perf_counter() - t0
    await client.close()
    produced = sum(r.usage.completion_tokens for rs in replies for r in rs)
    return seconds, produced, replies


def throughput(url: str, args: argparse.Namespace) -> list:
    """Tokens/s of 1 and of N sessions, alternating; returns the last N-session replies."""
    rates: dict[int, list[float]] = {1: [], args.sessions: []}
    asyncio.run(sessions(url, 1, 1, 4))  # warm-up
    replies: list = []
    for r in range(args.rounds):
        order = [1, args.sessions] if r % 2 == 0 else [args.sessions, 1]
        for count in order:
            seconds, produced, replies_now = asyncio.run(sessions(url, count, args.turns, args.tokens))
            rates[count].append(produced / seconds)
            print(
                f"  round {r + 1}: {count:>2} sessions, {produced} tokens in {seconds:.2f} s: {produced / seconds:.1f} tokens/s"
            )
            if count == args.sessions:
                replies = replies_now
    one, many = statistics.median(rates[1]), statistics.median(rates[args.sessions])
    print(
        f"throughput (median of {args.rounds}): 1 session {one:.1f} tokens/s, {args.sessions} sessions "
        f"{many:.1f} tokens/s: {many / one:.2f}x (goal >= 4x)"
    )
    return replies


def groups_of(replies: list) -> list[EpisodeGroup]:
    """The sessions' trajectories (all turns), in groups of 4 with rewards 0, 1, 2, 3."""
    trajectories = [
        Episode([completion_id(r) for r in rs], reward=float(i % 4)) for i, rs in enumerate(replies)
    ]
    return [EpisodeGroup(trajectories[j : j + 4]) for j in range(0, len(trajectories), 4)]


def train_calls(running, url: str, args: argparse.Namespace) -> None:
    """Server train calls vs make_batch + learn on the same samples, alternating; then the checkpoint."""
    trainer = running.service.trainer
    seen: list = []
    real_learn, real_batch = serve_step.learn, serve_step.make_batch

    def capture_batch(samples, **kwargs):
        seen.append(copy.deepcopy(samples))
        return real_batch(samples, **kwargs)

    def capture_learn(policy, spec, batch, *, seed):
        seen.append((spec, batch, seed))
        return real_learn(policy, spec, batch, seed=seed)

    serve_step.learn, serve_step.make_batch = capture_learn, capture_batch
    server_times, direct_times, learn_times = [], [], []
    try:
        for r in range(args.rounds):
            _, _, replies = asyncio.run(sessions(url, args.sessions, args.turns, args.tokens))
            groups = groups_of(replies)
            # a copy of the policy as it is before the call, for gspo train's update phase on the same samples
            twin = copy.deepcopy(trainer.policy)
            t0 = time.perf_counter()
            answer = Client(url).train(groups)
            server = time.perf_counter() - t0
            samples, (spec, batch, seed) = seen[-2:]
            t0 = time.perf_counter()
            make_batch(samples, advantage_scale=trainer.config.train.advantage_scale)
            with warnings.catch_warnings():  # the copied scheduler's note on the copied optimizer's step
                warnings.simplefilter("ignore")
                learn(twin, spec, batch, seed=seed)  # the batch the server trained on
            direct = time.perf_counter() - t0
            server_times.append(server)
            direct_times.append(direct)
            learn_times.append(answer["metrics"]["time_train"])
            print(
                f"  round {r + 1}: {len(batch.sequences)} sequences, {answer['metrics']['real_tokens']:.0f} tokens; "
                f"train call {server:.2f} s (server side {answer['metrics']['time_train']:.2f} s, snapshot "
                f"{answer['metrics']['time_snapshot']:.2f} s), gspo train's update phase {direct:.2f} s"
            )
    finally:
        serve_step.learn, serve_step.make_batch = real_learn, real_batch
    s, d = statistics.median(server_times), statistics.median(direct_times)
    print(
        f"train call (median of {args.rounds}): {s:.2f} s vs gspo train's update phase {d:.2f} s: {s / d:.3f}x (goal <= 1.1x)"
    )
    saves = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        Client(url).checkpoint()
        saves.append(time.perf_counter() - t0)
    print(
        f"durability (serve.durable=true adds a checkpoint before each answer): {statistics.median(saves):.2f} s per call"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="the tiny random model (a smoke run)")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}, torch threads {torch.get_num_threads()}, load average {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as run_dir:
        overrides = [
            f"output_dir={run_dir}",
            "report_to=[]",
            "serve.durable=false",
            f"serve.slots={max(args.sessions, 1)}",
        ]
        config = load_config("configs/tiny.yaml" if args.tiny else None, overrides)
        running = start_in_thread(build_service(config))
        try:
            print(
                f"model {'tiny' if args.tiny else 'SmolLM2-135M-Instruct'}, {args.sessions} sessions x {args.turns} turns x <= {args.tokens} tokens"
            )
            throughput(running.url, args)
            train_calls(running, running.url, args)
        finally:
            running.stop()
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
