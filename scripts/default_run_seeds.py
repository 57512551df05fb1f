"""The README's main job at several seeds: `gspo train seed=S` (the default config, plus any overrides), one
run at a time, each timed as a whole process. Prints a table row per seed: held-out accuracy first -> last,
wall seconds, peak RSS and bytes the process wrote to disk (/proc/PID/io, read until it exits), and the CPU;
appends each run's row (its evaluations too) to RUNS/results.jsonl as it ends, so a sweep stopped at any
point continues where it stopped (a seed already there is not trained again). The run folders' checkpoints
are deleted after each run (1.6 GB each); the metrics stay.

`--plot OUT.png RUNS [RUNS ...]`: held-out accuracy against step, the mean over seeds and the band from the
lowest to the highest, one line per RUNS folder (its label: the folder's name), and the table of each.

    HF_HUB_OFFLINE=1 python scripts/default_run_seeds.py [--seeds 0 1 2 3 4] [--runs runs/seeds] [key=value ...]
    HF_HUB_OFFLINE=1 python scripts/default_run_seeds.py --runs runs/seeds-plain configs/plain.yaml
    python scripts/default_run_seeds.py --plot docs/default_run_seeds.png runs/seeds runs/seeds-old
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def run(seed: int, folder: Path, overrides: list[str]) -> dict:
    """One whole `gspo train` process: its held-out accuracy, wall seconds, peak RSS and bytes written."""
    command = [sys.executable, "-m", "gspo", "train", *overrides, f"seed={seed}", f"output_dir={folder}"]
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
    evals = [(r["step"], r["accuracy"]) for r in rows if r["kind"] == "eval"]
    notes = [
        line
        for line in log.read_text().splitlines()
        if line.startswith(("warning: collapse", "note: saturated"))
    ]
    shutil.rmtree(folder / "checkpoints", ignore_errors=True)
    return {
        "seed": seed,
        "overrides": overrides,
        "evals": evals,
        "first": evals[0][1],
        "last": evals[-1][1],
        "seconds": seconds,
        "peak_gib": usage.ru_maxrss / 2**20,
        "written_gb": written / 1e9,
        "notes": notes,
        "cpu": cpu_name(),
    }


def results(runs: Path) -> dict[int, dict]:
    path = runs / "results.jsonl"
    if not path.is_file():
        return {}
    return {r["seed"]: r for r in map(json.loads, path.read_text().splitlines())}


def table(rows: list[dict]) -> str:
    lines = ["| seed | held-out accuracy | wall | peak RSS | disk written |", "|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["seed"]):
        lines.append(
            f"| {r['seed']} | {r['first']:.3f} -> {r['last']:.3f} | {r['seconds']:.0f} s | {r['peak_gib']:.2f} GiB "
            f"| {r['written_gb']:.2f} GB |"
        )
    lasts = [r["last"] for r in rows]
    walls = [r["seconds"] for r in rows]
    lines.append(
        f"\nmean held-out {statistics.mean(lasts):.3f}, lowest {min(lasts):.3f}, highest {max(lasts):.3f}; wall "
        f"{min(walls):.0f}-{max(walls):.0f} s (median {statistics.median(walls):.0f} s)"
    )
    return "\n".join(lines)


def plot(path: Path, sets: list[Path]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for runs in sets:
        rows = list(results(runs).values())
        if not rows:
            continue
        steps = [s for s, _ in rows[0]["evals"]]
        curves = [[a for _, a in r["evals"]] for r in rows if [s for s, _ in r["evals"]] == steps]
        mean = [statistics.mean(col) for col in zip(*curves, strict=True)]
        (line,) = ax.plot(steps, mean, marker="o", label=f"{runs.name} ({len(curves)} seeds)")
        low = [min(col) for col in zip(*curves, strict=True)]
        high = [max(col) for col in zip(*curves, strict=True)]
        ax.fill_between(steps, low, high, alpha=0.15, color=line.get_color())
        print(
            f"## {runs.name} ({rows[0]['cpu']}; overrides: {rows[0]['overrides'] or 'none'})\n{table(rows)}\n"
        )
    ax.set_xlabel("rollout batch (step)")
    ax.set_ylabel("held-out accuracy (greedy, 40 sums)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--runs", type=Path, default=Path("runs/seeds"))
    parser.add_argument("--plot", nargs="+", metavar="OUT.png RUNS", help="plot and tabulate finished sweeps")
    parser.add_argument(
        "overrides", nargs="*", help="a config file and key=value overrides (default: the default config)"
    )
    args = parser.parse_args()
    if args.plot:
        plot(Path(args.plot[0]), [Path(p) for p in args.plot[1:]])
        return
    print(f"{cpu_name()}, {os.cpu_count()} CPUs; overrides: {args.overrides or 'none'}")
    done = results(args.runs)
    for seed in args.seeds:
        if seed in done:
            continue
        folder = args.runs / f"seed{seed}"
        if folder.exists():  # an unfinished run of this script's: started again
            shutil.rmtree(folder)
        r = run(seed, folder, args.overrides)
        done[seed] = r
        with (args.runs / "results.jsonl").open("a") as out:
            out.write(json.dumps(r) + "\n")
        print(f"seed {seed}: {r['first']:.3f} -> {r['last']:.3f}, {r['seconds']:.0f} s", flush=True)
    print(table([done[s] for s in args.seeds]))


if __name__ == "__main__":
    main()
