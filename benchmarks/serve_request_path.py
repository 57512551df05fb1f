"""The path of one `gspo serve` request through gspo's modules: which it enters, in what order, how often.

The real server (uvicorn in this process, 127.0.0.1) on the tiny random model, driven by the official openai
SDK: one chat completion (not streamed) and one streamed, each of up to --tokens tokens, after one untraced
warm-up. A profile hook (threading.setprofile, so it sees the server's event-loop thread and the engine's
driver thread) counts every Python call into gspo's source while a request runs: calls per module, and
entries, the calls made from outside the module (another gspo module, or Starlette and asyncio resuming a
handler). The path lists each thread's entries in order, repeats collapsed ("engine x3"); the driver
thread runs inside sampling.driver's loop throughout, so its path lists what that loop enters. Counts, not
times: they do not depend on the machine's load.

Run:  HF_HUB_OFFLINE=1 python benchmarks/serve_request_path.py [--tokens 6] [--functions]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai

import gspo
from gspo.config import load_config
from gspo.serve.server import Running, build_service, start_in_thread

QUESTION = [{"role": "user", "content": "What is 2+3?"}]
ENGINE_THREAD = "gspo-engine"
"""The driver thread's name (gspo.sampling.driver); every other traced thread is the server's."""


class Tracer:
    """A profile hook: while `on`, each call into gspo's source as (thread, module, entered from outside)."""

    def __init__(self) -> None:
        self.root = os.path.dirname(gspo.__file__) + os.sep
        self.on = False
        self.calls: list[tuple[str, str, bool]] = []
        self.functions: collections.Counter[str] = collections.Counter()
        self._modules: dict[str, str | None] = {}

    def module(self, filename: str) -> str | None:
        if filename not in self._modules:
            inside = filename.startswith(self.root)
            name = filename[len(self.root) :].removesuffix(".py").replace(os.sep, ".")
            self._modules[filename] = name.removesuffix(".__init__") if inside else None
        return self._modules[filename]

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if not self.on or event != "call":
            return
        module = self.module(frame.f_code.co_filename)
        if module is None:
            return
        caller = frame.f_back
        entered = caller is None or self.module(caller.f_code.co_filename) != module
        thread = "engine" if threading.current_thread().name == ENGINE_THREAD else "server"
        self.calls.append((thread, module, entered))
        self.functions[f"{module}.{frame.f_code.co_qualname}"] += 1


def settle(running: Running) -> None:
    """Wait until the engine is idle and the server has finished the request (its last sends)."""
    driver = running.service.inference.driver
    while not driver.engine.idle:
        time.sleep(0.01)
    time.sleep(0.2)


def traced(tracer: Tracer, running: Running, request: Callable[[], int]) -> tuple[int, list, dict]:
    """(completion tokens, the gspo calls made while `request` ran, the calls per function)."""
    settle(running)
    tracer.calls, tracer.functions = [], collections.Counter()
    tracer.on = True
    tokens = request()
    settle(running)
    tracer.on = False
    return tokens, tracer.calls, tracer.functions


def path(calls: list[tuple[str, str, bool]], thread: str) -> str:
    """One thread's module entries in order, consecutive repeats collapsed."""
    runs: list[list] = []
    for where, module, entered in calls:
        if where != thread or not entered:
            continue
        if runs and runs[-1][0] == module:
            runs[-1][1] += 1
        else:
            runs.append([module, 1])
    return " > ".join(m if k == 1 else f"{m} x{k}" for m, k in runs) or "(none)"


def report(
    title: str,
    tokens: int,
    calls: list[tuple[str, str, bool]],
    functions: dict[str, int],
    *,
    by_function: bool,
) -> None:
    count = collections.Counter(module for _, module, _ in calls)
    entries = collections.Counter(module for _, module, entered in calls if entered)
    first = {}
    for i, (_, module, _) in enumerate(calls):
        first.setdefault(module, i)
    print(
        f"\n{title}, {tokens} tokens: {len(calls)} gspo calls, {sum(entries.values())} module entries, "
        f"{len(count)} modules"
    )
    print(f"  {'module':<28}{'calls':>7}{'entries':>9}")
    for module in sorted(count, key=first.__getitem__):
        print(f"  {module:<28}{count[module]:>7}{entries[module]:>9}")
    print(f"  server thread: {path(calls, 'server')}")
    print(f"  engine thread, from sampling.driver's loop: {path(calls, 'engine')}")
    if by_function:
        for name, k in sorted(functions.items(), key=lambda item: -item[1]):
            print(f"    {k:>5}  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=6, help="max_tokens of each request")
    parser.add_argument("--seed", type=int, default=3, help="the requests' sampling seed")
    parser.add_argument("--functions", action="store_true", help="also list the calls per function")
    args = parser.parse_args()
    tracer = Tracer()
    threading.setprofile(tracer)  # threads started from here on: the driver's and the server's
    with tempfile.TemporaryDirectory() as run_dir:
        config = load_config(
            Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml",
            [f"output_dir={run_dir}", "report_to=[]", "progress=false"],
        )
        running = start_in_thread(build_service(config))
        try:
            client = openai.OpenAI(base_url=running.url, api_key="none", max_retries=0)
            settings = {"model": "gspo", "messages": QUESTION, "max_tokens": args.tokens, "seed": args.seed}

            def whole() -> int:
                return client.chat.completions.create(**settings).usage.completion_tokens

            def streamed() -> int:
                chunks = client.chat.completions.create(
                    **settings, stream=True, stream_options={"include_usage": True}
                )
                return [c for c in chunks][-1].usage.completion_tokens

            whole()  # warm-up: first-call work (imports, caches) is not part of a request's path
            report("chat completion", *traced(tracer, running, whole), by_function=args.functions)
            report("streamed chat completion", *traced(tracer, running, streamed), by_function=args.functions)
        finally:
            running.stop()
            threading.setprofile(None)
    print(
        f"\npython {sys.version.split()[0]}; command: python benchmarks/serve_request_path.py --tokens {args.tokens}"
    )


if __name__ == "__main__":
    main()
