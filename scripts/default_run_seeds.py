"""The README's main job at several seeds: `gspo train seed=S` (the default config, plus any overrides), one
run at a time, each timed as a whole process. Prints a table row per seed: held-out accuracy first -> last,
wall seconds, peak RSS and bytes the process wrote to disk (/proc/PID/io, read until it exits), and the CPU.

    HF_HUB_OFFLINE=1 python scripts/default_run_seeds.py [--seeds 0 1 2 3 4] [--runs runs/seeds] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def run(seed: int, folder: Path, overrides: list[str]) -> dict[str, float]:
    """One whole `gspo train` process: its held-out accuracy, wall seconds, peak RSS and bytes written."""
    command = [sys.executable, "-m", "gspo", "train", f"seed={seed}", f"output_dir={folder}", *overrides]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    folder.parent.mkdir(parents=True, exist_ok=True)
    log = folder.parent / f"seed{seed}.log"
    start = time.perf_counter()
    with log.open("w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    written = 0
    while True:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            break
        try:
            io = dict(line.split(": ") for line in Path(f"/proc/{process.pid}/io").read_text().splitlines())
            written = max(written, int(io["write_bytes"]))
        except (OSError, ValueError, KeyError):  # gone between the wait and the read
            pass
        time.sleep(0.2)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"seed {seed} failed:\n{log.read_text()[-3000:]}")
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if r["kind"] == "eval"]
    return {
        "first": evals[0]["accuracy"],
        "last": evals[-1]["accuracy"],
        "seconds": seconds,
        "peak_gib": usage.ru_maxrss / 2**20,
        "written_gb": written / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--runs", type=Path, default=Path("runs/seeds"))
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the default config")
    args = parser.parse_args()
    print(f"{cpu_name()}, {os.cpu_count()} CPUs; overrides: {args.overrides or 'none'}")
    print("| seed | held-out accuracy | wall | peak RSS | disk written |\n|---|---|---|---|---|")
    results = []
    for seed in args.seeds:
        folder = args.runs / f"seed{seed}"
        if folder.exists():
            subprocess.run(["rm", "-rf", str(folder)], check=True)
        r = run(seed, folder, args.overrides)
        results.append(r)
        row = f"| {seed} | {r['first']:.3f} -> {r['last']:.3f} | {r['seconds']:.0f} s | {r['peak_gib']:.2f} GiB |"
        print(f"{row} {r['written_gb']:.2f} GB |", flush=True)
    mean = sum(r["last"] for r in results) / len(results)
    low = min(r["last"] for r in results)
    print(f"mean held-out {mean:.3f}, lowest {low:.3f}")


if __name__ == "__main__":
    main()
