"""A bounded soak of `gspo serve`: --seconds of mixed load from --clients clients against the real server
(`gspo serve configs/tiny.yaml` in its own process, 127.0.0.1, a free port), every answer checked.

Each client loops, drawing one of (weights in brackets):
- chat (8): a non-streamed chat completion, n 1-3, max_tokens 6;
- stream (2): the same, streamed (one client in five streams, as in the load that once stalled streams);
- text (1): a /v1/completions request with a text prompt, n 1-3;
- oversized (1): a 3 MB body, with its Content-Length or chunked: must be a 413;
- too long (1): a prompt past the context window, under the body limit: must be a 400;
- disconnect (1): a stream closed after its first chunk, or a chat request given up after 50 ms.
A trainer client posts the non-streamed answers' choices as trajectory groups (rewards 0..n-1) every
--train-every seconds: must be trained (200) or refused as stale (400 stale_completion).

Checked in every answer: the status is the expected one; each choice's text is the decoding of its
token_ids (the stop token left out), one log-prob <= 0 per token id, a finish reason; a stream ends with
[DONE]. Counted: stalls (a request not given up on purpose that got no byte for --stall seconds), 5xx
answers (streamed errors included), wrong answers. Printed: those counts (stalls and 5xx must be 0), the
server's RSS (VmRSS, sampled every 0.2 s, and VmHWM), /v1/status at the end (nothing running or waiting,
no engine error). Exit 1 when anything failed.

    HF_HUB_OFFLINE=1 python benchmarks/serve_soak.py [--seconds 30] [--clients 50]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from gspo.models import tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
KINDS = {"chat": 8, "stream": 2, "text": 1, "oversized": 1, "too long": 1, "disconnect": 1}
QUESTIONS = ["What is 2+3?", "What is 4+1?", "Add 7 and 2.", "What is 9+0?"]


class Soak:
    """The load's tallies and the checks of each answer."""

    def __init__(self, url: str, stall: float) -> None:
        self.url, self.stall = url, stall
        self.tokenizer = tiny_tokenizer()
        self.counts: collections.Counter[str] = collections.Counter()
        self.problems: list[str] = []
        self.stalls = self.server_errors = 0
        self.groups: list[dict] = []

    def wrong(self, kind: str, why: str) -> None:
        self.counts["wrong"] += 1
        if len(self.problems) < 10:
            self.problems.append(f"{kind}: {why}")

    def check_choice(self, kind: str, text: str, ids: list[int], logprobs: list[float], reason: str) -> None:
        shown = ids[:-1] if reason == "stop" else ids
        if reason not in ("stop", "length") or not 1 <= len(ids) <= 6:
            self.wrong(kind, f"finish_reason {reason!r} with {len(ids)} tokens")
        elif text != self.tokenizer.decode(shown, skip_special_tokens=True):
            self.wrong(kind, f"text {text!r} is not the decoding of its token_ids {ids}")
        elif len(logprobs) != len(ids) or not all(lp <= 0 for lp in logprobs):
            self.wrong(kind, f"{len(logprobs)} log-probs for {len(ids)} tokens: {logprobs}")

    def status(self, kind: str, response: httpx.Response, expected: int) -> bool:
        if response.status_code >= 500:
            self.server_errors += 1
        if response.status_code != expected:
            self.wrong(kind, f"status {response.status_code}, expected {expected}: {response.text[:200]}")
            return False
        return True


def chat_body(n: int) -> dict:
    question = random.choice(QUESTIONS)
    return {"model": "gspo", "messages": [{"role": "user", "content": question}], "max_tokens": 6, "n": n}


async def chat(soak: Soak, client: httpx.AsyncClient) -> None:
    n = random.randint(1, 3)
    response = await client.post("/chat/completions", json=chat_body(n))
    if not soak.status("chat", response, 200):
        return
    choices = response.json()["choices"]
    for c in choices:
        soak.check_choice(
            "chat", c["message"]["content"], c["token_ids"], c["token_logprobs"], c["finish_reason"]
        )
    if n >= 2:
        soak.groups.append(
            {
                "trajectories": [
                    {"completion_ids": [c["completion_id"]], "reward": float(c["index"])} for c in choices
                ]
            }
        )


async def sse(response: httpx.Response) -> AsyncIterator[str]:
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


async def stream(soak: Soak, client: httpx.AsyncClient, *, leave: bool = False) -> None:
    n = random.randint(1, 3)
    parts: dict[int, dict] = {i: {"text": "", "ids": [], "logprobs": [], "reason": None} for i in range(n)}
    async with client.stream("POST", "/chat/completions", json=chat_body(n) | {"stream": True}) as response:
        if not soak.status("stream", response, 200):
            return
        data = [chunk async for chunk in _until_left(sse(response), leave)]
    if leave:
        return
    if not data or data[-1] != "[DONE]":
        soak.wrong("stream", f"ended without [DONE]: {data[-1:]}")
        return
    for raw in data[:-1]:
        chunk = json.loads(raw)
        if "error" in chunk:
            soak.server_errors += chunk["error"]["type"] == "server_error"
            soak.wrong("stream", f"error event {chunk['error']}")
            return
        for c in chunk["choices"]:
            part = parts[c["index"]]
            part["text"] += c["delta"].get("content") or ""
            part["ids"] += c.get("token_ids") or []
            part["reason"] = c.get("finish_reason") or part["reason"]
            part["logprobs"] = c.get("token_logprobs", part["logprobs"])  # a choice's last part has them all
    for part in parts.values():
        soak.check_choice("stream", part["text"], part["ids"], part["logprobs"], part["reason"])


async def _until_left(chunks: AsyncIterator[str], leave: bool) -> AsyncIterator[str]:
    async for chunk in chunks:
        yield chunk
        if leave:
            return


async def text(soak: Soak, client: httpx.AsyncClient) -> None:
    body = {"model": "gspo", "prompt": random.choice(QUESTIONS), "max_tokens": 6, "n": random.randint(1, 3)}
    response = await client.post("/completions", json=body)
    if soak.status("text", response, 200):
        for c in response.json()["choices"]:
            soak.check_choice("text", c["text"], c["token_ids"], c["token_logprobs"], c["finish_reason"])


async def oversized(soak: Soak, client: httpx.AsyncClient) -> None:
    raw = json.dumps(chat_body(1) | {"messages": [{"role": "user", "content": "7" * 3_000_000}]}).encode()
    if random.random() < 0.5:
        response = await client.post(
            "/chat/completions", content=raw, headers={"content-type": "application/json"}
        )
    else:

        async def chunks() -> AsyncIterator[bytes]:
            for start in range(0, len(raw), 65536):
                yield raw[start : start + 65536]

        response = await client.post("/chat/completions", content=chunks())
    if soak.status("oversized", response, 413) and response.json()["error"]["code"] != "body_too_large":
        soak.wrong("oversized", response.text[:200])


async def too_long(soak: Soak, client: httpx.AsyncClient) -> None:
    body = chat_body(1) | {"messages": [{"role": "user", "content": "7" * 100_000}]}
    response = await client.post("/chat/completions", json=body)
    if (
        soak.status("too long", response, 400)
        and response.json()["error"]["code"] != "context_length_exceeded"
    ):
        soak.wrong("too long", response.text[:200])


async def disconnect(soak: Soak, client: httpx.AsyncClient) -> None:
    if random.random() < 0.5:
        await stream(soak, client, leave=True)
        return
    with contextlib.suppress(httpx.TimeoutException):
        await client.post("/chat/completions", json=chat_body(2), timeout=0.05)


ACTIONS = {"chat": chat, "stream": stream, "text": text, "oversized": oversized, "too long": too_long}


async def load(soak: Soak, until: float) -> None:
    timeout = httpx.Timeout(soak.stall, connect=soak.stall)
    async with httpx.AsyncClient(base_url=soak.url, timeout=timeout) as client:
        while time.monotonic() < until:
            kind = random.choices(list(KINDS), weights=list(KINDS.values()))[0]
            soak.counts[kind] += 1
            try:
                await (disconnect if kind == "disconnect" else ACTIONS[kind])(soak, client)
            except httpx.TimeoutException:  # no byte for `stall` seconds (the given-up ones are caught above)
                soak.stalls += 1
                soak.wrong(kind, "stalled")
            except httpx.TransportError as error:
                soak.wrong(kind, f"{type(error).__name__}: {error}")


async def trainer(soak: Soak, until: float, every: float) -> None:
    async with httpx.AsyncClient(base_url=soak.url, timeout=120) as client:
        while time.monotonic() < until:
            await asyncio.sleep(every)
            groups, soak.groups = soak.groups[-4:], []  # the newest: the older ones may be stale
            if not groups:
                continue
            response = await client.post("/train", json={"groups": groups})
            soak.counts["train"] += 1
            if response.status_code == 400 and response.json()["error"]["code"] == "stale_completion":
                soak.counts["train refused: stale"] += 1
            elif soak.status("train", response, 200):
                soak.counts["trained"] += 1


def rss_mib(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key} in /proc/{pid}/status (Linux only)")


async def watch_rss(pid: int, peak: list[float]) -> None:
    while True:
        peak[0] = max(peak[0], rss_mib(pid, "VmRSS"))
        await asyncio.sleep(0.2)


async def soak_run(url: str, pid: int, args: argparse.Namespace) -> tuple[Soak, float]:
    soak = Soak(url, args.stall)
    until = time.monotonic() + args.seconds
    peak = [0.0]
    watcher = asyncio.ensure_future(watch_rss(pid, peak))
    clients = [load(soak, until) for _ in range(args.clients)]
    await asyncio.gather(*clients, trainer(soak, until, args.train_every))
    watcher.cancel()
    return soak, peak[0]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument(
        "--stall", type=float, default=15.0, help="seconds without a byte that count as a stall"
    )
    parser.add_argument("--train-every", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    random.seed(args.seed)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "gspo", "serve", str(ROOT / "configs" / "tiny.yaml")]
        command += [f"output_dir={Path(folder) / 'run'}", "serve.port=0", "tensorboard=false"]
        log = open(Path(folder) / "server.log", "w")  # noqa: SIM115 (closed with the server)
        server = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            url = server.stdout.readline().split()[2]
            start = rss_mib(server.pid, "VmRSS")
            t0 = time.perf_counter()
            soak, peak = asyncio.run(soak_run(url, server.pid, args))
            wall = time.perf_counter() - t0
            status = httpx.get(url + "/status", timeout=30).json()
            hwm = rss_mib(server.pid, "VmHWM")
        finally:
            server.terminate()
            server.wait(30)
            log.close()
        tracebacks = (Path(folder) / "server.log").read_text().count("Traceback")
    engine = status["engine"]
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores, load average {os.getloadavg()}")
    print(f"{args.clients} clients, {wall:.1f} s (load for {args.seconds:.0f} s), seed {args.seed}")
    print("requests: " + ", ".join(f"{k} {v}" for k, v in sorted(soak.counts.items()) if k != "wrong"))
    print(f"stalls: {soak.stalls}")
    print(f"5xx answers: {soak.server_errors}")
    print(f"wrong answers: {soak.counts['wrong']}" + "".join(f"\n  {p}" for p in soak.problems))
    print(f"tracebacks in the server's log: {tracebacks}")
    print(f"server RSS: {start:.0f} MiB at start, peak {peak:.0f} MiB sampled, VmHWM {hwm:.0f} MiB")
    print(
        f"at the end: running {engine['running_samples']}, waiting {engine['waiting_samples']}, engine errors "
        f"{engine['errors']}, policy version {status['trainer']['version']}"
    )
    failed = soak.stalls or soak.server_errors or soak.counts["wrong"] or tracebacks or engine["errors"]
    failed = failed or engine["running_samples"] or engine["waiting_samples"]
    print("FAILED" if failed else "OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
