"""Peak memory of `gspo serve` for one large request: how much a single body can add to the server's RSS.

Starts `gspo serve configs/tiny.yaml` (127.0.0.1, a free port) once per case, warms it with one small chat
request, then sends one large body and prints the answer's status and the server's peak RSS (VmHWM in
/proc/PID/status) before and after. Cases (each about --mb MB of JSON):
- chat: one user message of digits (a text far past the context window);
- text: /v1/completions with the same text as its prompt;
- messages: one-character chat messages, alternating user and assistant (the most objects per byte);
- ids: /v1/completions with a prompt of token ids.
--max-body raises serve.max_body_bytes so the body is read (the default 2 MiB would refuse it at once).

    HF_HUB_OFFLINE=1 python benchmarks/serve_body_memory.py [--mb 3] [--cases chat text messages ids]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc (Linux only)")


def body_of(case: str, size: int) -> tuple[str, dict]:
    text = "12 + 3 " * (size // 7)
    if case == "chat":
        return "/chat/completions", {"messages": [{"role": "user", "content": text}]}
    if case == "text":
        return "/completions", {"prompt": text}
    if case == "messages":
        roles = ("user", "assistant")
        return "/chat/completions", {
            "messages": [{"role": roles[i % 2], "content": "7"} for i in range(size // 38)]
        }
    if case == "ids":
        return "/completions", {"prompt": [5] * (size // 3)}
    raise ValueError(case)


def measure(case: str, size: int, max_body: int, folder: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "gspo", "serve", str(ROOT / "configs" / "tiny.yaml")]
    command += [f"output_dir={folder / case}", "serve.port=0", "tensorboard=false"]
    command += [f"serve.max_body_bytes={max_body}"]
    server = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = server.stdout.readline().split()[2]
        warm = {"model": "gspo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        httpx.post(url + "/chat/completions", json=warm, timeout=60).raise_for_status()
        before = peak_rss_mib(server.pid)
        path, body = body_of(case, size)
        content = json.dumps({"model": "gspo", "max_tokens": 2} | body)
        t0 = time.perf_counter()
        response = httpx.post(
            url + path, content=content, headers={"content-type": "application/json"}, timeout=600
        )
        seconds = time.perf_counter() - t0
        message = response.json()["error"]["message"] if response.status_code >= 400 else "ok"
        print(
            f"{case:9s} {len(content) / 1e6:4.1f} MB  {response.status_code}  {seconds:5.1f} s  "
            f"peak RSS {before:6.0f} -> {peak_rss_mib(server.pid):6.0f} MiB  ({message[:60]})",
            flush=True,
        )
    finally:
        server.kill()  # a server still busy with the body would not stop in time
        server.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=float, default=3.0, help="body size in MB")
    parser.add_argument("--cases", nargs="+", default=["chat", "text", "messages", "ids"])
    parser.add_argument("--max-body", type=int, default=2**30, help="serve.max_body_bytes")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        for case in args.cases:
            measure(case, int(args.mb * 1e6), args.max_body, Path(folder))


if __name__ == "__main__":
    main()
