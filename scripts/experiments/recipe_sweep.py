"""The default run's recipe, chosen by evidence: arms (overrides of the default config) x seeds, one `gspo train`
at a time, each timed as a whole process. Results go to RUNS/results.jsonl as each run ends, so a sweep
stopped at any point continues where it stopped when started again (a finished run is not trained again; an
unfinished one starts over). `--report` prints the per-arm table (held-out accuracy per seed, mean, min,
wall) and writes RUNS/curves.png: held-out accuracy against step, the mean and the min-max band of each arm.

    HF_HUB_OFFLINE=1 python scripts/experiments/recipe_sweep.py --arms default dynamic --seeds 1 2 3 4 5
    HF_HUB_OFFLINE=1 python scripts/experiments/recipe_sweep.py --arm "mine=train.lr=5e-6 rollout.temperature=1.2"
    python scripts/experiments/recipe_sweep.py --report [--arms ...]

A study runs alone on the machine: two heavy processes on 2 cores slow each other 10-20x.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

EVERY_5 = ["eval.every=5"]  # evaluations draw from their own seeds: how often changes nothing trained
EXACT = "rewards={exact_answer: 1.0, correct_number: 0.5}"
ARMS: dict[str, list[str]] = {
    "default": EVERY_5,
    "dynamic": [*EVERY_5, "rollout.dynamic_sampling=true"],
    "entropy": [*EVERY_5, "train.entropy_coef=0.01"],
    "dynamic+entropy": [*EVERY_5, "rollout.dynamic_sampling=true", "train.entropy_coef=0.01"],
    "dynamic, 2 minibatches": [*EVERY_5, "rollout.dynamic_sampling=true", "train.minibatches=2"],
    "temperature 1.2": [*EVERY_5, "rollout.temperature=1.2"],
    # the centred rewards divided by the batch's std, not each group's: a group where one completion is a
    # wrong bare number among zeros no longer gives it the largest advantage there is
    "batch advantages": [*EVERY_5, "train.advantage_scale=batch"],
    "batch advantages+entropy": [*EVERY_5, "train.advantage_scale=batch", "train.entropy_coef=0.01"],
    "KL 0.04": [*EVERY_5, "train.beta=0.04"],
    # no reward for a wrong bare number: early on, when right answers are rare, `number_format` pays any
    # bare number, and the policy settles on a few constant ones ("10") before it learns the sums
    "exact rewards": [*EVERY_5, EXACT],
    "exact rewards+entropy": [*EVERY_5, EXACT, "train.entropy_coef=0.01"],
    "exact rewards, temperature 1.2": [*EVERY_5, EXACT, "rollout.temperature=1.2"],
    "exact rewards, lr 2e-5": [*EVERY_5, EXACT, "train.lr=2e-5"],
    "lr 2e-5": [*EVERY_5, "train.lr=2e-5"],
    "temperature 1.5": [*EVERY_5, "rollout.temperature=1.5"],
    "temperature 1.2, lr 2e-5": [*EVERY_5, "rollout.temperature=1.2", "train.lr=2e-5"],
    "temperature 1.2+entropy": [*EVERY_5, "rollout.temperature=1.2", "train.entropy_coef=0.01"],
    # with the batch's std, a small format weight gives a wrong bare number a small advantage (with each
    # group's, any weight gives it the group's largest)
    "temperature 1.2, lr 2e-5, G16 P4": [
        *EVERY_5,
        "rollout.temperature=1.2",
        "train.lr=2e-5",
        "rollout.group_size=16",
        "rollout.prompts_per_step=4",
    ],
    "temperature 1.2, lr 2e-5, entropy 0.01": [
        *EVERY_5,
        "rollout.temperature=1.2",
        "train.lr=2e-5",
        "train.entropy_coef=0.01",
    ],
    # the default run's stability settings (configs/plain.yaml is the default without them)
    "temperature 1.2, lr 2e-5, dynamic": [
        *EVERY_5,
        "rollout.temperature=1.2",
        "train.lr=2e-5",
        "rollout.dynamic_sampling=true",
    ],
    "temperature 1.2, lr 3e-5": [*EVERY_5, "rollout.temperature=1.2", "train.lr=3e-5"],
    "temperature 1.3, lr 2e-5": [*EVERY_5, "rollout.temperature=1.3", "train.lr=2e-5"],
    "temperature 1.2, lr 2e-5, batch advantages": [
        *EVERY_5,
        "rollout.temperature=1.2",
        "train.lr=2e-5",
        "train.advantage_scale=batch",
    ],
    "batch advantages, format 0.05": [
        *EVERY_5,
        "train.advantage_scale=batch",
        "rewards={exact_answer: 1.0, correct_number: 0.5, number_format: 0.05}",
    ],
}
"""Named arms: each a list of `gspo train` overrides of the default config. `--arm NAME=K=V K=V` adds one."""


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def done_runs(results: Path) -> dict[tuple[str, int], dict]:
    """The runs already in RUNS/results.jsonl, by (arm, seed)."""
    if not results.is_file():
        return {}
    rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    return {(r["arm"], r["seed"]): r for r in rows}


def train(arm: str, overrides: list[str], seed: int, runs: Path) -> dict:
    """One whole `gspo train` process of ``arm`` at ``seed``: its eval curve, wall seconds and last metrics."""
    folder = runs / arm.replace(" ", "_") / f"seed{seed}"
    if folder.exists():  # an unfinished run starts over (its folder is this script's own)
        shutil.rmtree(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "gspo", "train", f"seed={seed}", f"output_dir={folder}"]
    command += ["report_to=[]", "progress=false", *overrides]
    log = folder.parent / f"seed{seed}.log"
    start = time.perf_counter()
    with log.open("w") as out:
        code = subprocess.run(
            command, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=out, stderr=out
        )
    wall = time.perf_counter() - start
    if code.returncode != 0:
        raise SystemExit(f"{arm} seed {seed} failed (exit {code.returncode}):\n{log.read_text()[-3000:]}")
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [(r["step"], r["accuracy"]) for r in rows if r["kind"] == "eval"]
    train_rows = [r for r in rows if r["kind"] == "train"]
    shutil.rmtree(
        folder / "checkpoints", ignore_errors=True
    )  # 1.6 GB each; the curve is what the sweep keeps
    keys = ("zero_std_groups", "groups_drawn", "extra_groups", "entropy", "entropy_coef", "time_update")
    return {
        "arm": arm,
        "seed": seed,
        "overrides": overrides,
        "evals": evals,
        "first": evals[0][1],
        "last": evals[-1][1],
        "wall": wall,
        "train_means": {
            k: sum(r.get(k, 0.0) for r in train_rows) / max(len(train_rows), 1)
            for k in keys
            if any(k in r for r in train_rows)
        },
    }


def report(results: Path, arms: list[str] | None) -> None:
    rows = done_runs(results)
    names = arms or list(dict.fromkeys(arm for arm, _ in rows))
    print(
        "| arm | seeds | held-out accuracy per seed | mean | min | wall (mean) |\n|---|---|---|---|---|---|"
    )
    for arm in names:
        mine = sorted((r for (a, _), r in rows.items() if a == arm), key=lambda r: r["seed"])
        if not mine:
            continue
        lasts = [r["last"] for r in mine]
        per_seed = ", ".join(f"{r['seed']}: {r['last']:.3f}" for r in mine)
        wall = sum(r["wall"] for r in mine) / len(mine)
        print(
            f"| {arm} | {len(mine)} | {per_seed} | {sum(lasts) / len(lasts):.3f} | {min(lasts):.3f} | {wall:.0f} s |"
        )
    plot(rows, names, results.parent / "curves.png")


def plot(rows: dict[tuple[str, int], dict], arms: list[str], path: Path) -> None:
    """Held-out accuracy against step: each arm's mean over its seeds, and the band from min to max."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm in arms:
        curves = [r["evals"] for (a, _), r in rows.items() if a == arm]
        if not curves:
            continue
        steps = [s for s, _ in curves[0]]
        if any([s for s, _ in c] != steps for c in curves):
            continue
        values = [[acc for _, acc in c] for c in curves]
        mean = [sum(col) / len(col) for col in zip(*values, strict=True)]
        (line,) = ax.plot(steps, mean, marker="o", label=f"{arm} ({len(curves)} seeds)")
        ax.fill_between(
            steps,
            [min(c) for c in zip(*values, strict=True)],
            [max(c) for c in zip(*values, strict=True)],
            alpha=0.15,
            color=line.get_color(),
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
    parser.add_argument("--arms", nargs="+", help=f"named arms to run: {', '.join(ARMS)}")
    parser.add_argument("--arm", action="append", default=[], help="NAME=K=V K=V ...: an arm of your own")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "recipe-sweep")
    parser.add_argument("--report", action="store_true", help="print the table and plot; train nothing")
    args = parser.parse_args()
    arms = {name: ARMS[name] for name in args.arms or []}
    for spec in args.arm:
        name, _, overrides = spec.partition("=")
        arms[name] = overrides.split()
    results = args.runs / "results.jsonl"
    if args.report:
        report(results, list(arms) or None)
        return
    args.runs.mkdir(parents=True, exist_ok=True)
    print(f"{cpu_name()}, {os.cpu_count()} CPUs", flush=True)
    done = done_runs(results)
    # seeds outermost: every arm gets its first seeds before any arm gets its last
    for seed in args.seeds:
        for arm, overrides in arms.items():
            if (arm, seed) in done:
                continue
            row = train(arm, overrides, seed, args.runs)
            with results.open("a") as out:
                out.write(json.dumps(row) + "\n")
            print(
                f"{arm} seed {seed}: {row['first']:.3f} -> {row['last']:.3f}, {row['wall']:.0f} s", flush=True
            )
    report(results, list(arms))


if __name__ == "__main__":
    main()
