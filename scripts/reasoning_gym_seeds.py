"""The reasoning-gym run at several seeds: held-out accuracy before and after, the time split, a plot.

Trains `configs/reasoning_gym.yaml` (or --config) once per seed, one run at a time (--parallel: all at
once), then reads each run folder's metrics.jsonl and writes, between the markers `<!-- seeds:begin -->` and `<!-- seeds:end -->` of
--doc (docs/reasoning_gym.md):
  * per seed: held-out accuracy (the first reward, greedy) before training and at the last step, mean
    completion length, seconds per rollout batch split into generation / old-policy log-probs / updates,
    and the run's wall time;
  * mean ± std over seeds, and whether the rise exceeds the seed spread (mean rise > 2 x the std over
    seeds of the final accuracy; the accuracy before training is the same at every seed: same model,
    same held-out problems, greedy);
  * the plot --plot (held-out accuracy and training completion length per step, each seed and the mean).

Run:  HF_HUB_OFFLINE=1 python scripts/reasoning_gym_seeds.py [--seeds 3] [--threads 2] [--parallel] \
          [key=value ...]
A finished run (its summary.md written) is not trained again; --report-only only reads the run folders.
`--summarize DIR ...` prints, for any run folders (the pilots in docs/reasoning_gym.md), the held-out
accuracy at each evaluation, the training completion length and the time split, and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- seeds:begin -->", "<!-- seeds:end -->"


@dataclass
class SeedResult:
    seed: int
    steps: list[int]
    accuracy: list[float]
    train_steps: list[int]
    train_length: list[float]
    time_rollout: float
    time_old_logprobs: float
    time_update: float
    wall_minutes: float | None

    @property
    def before(self) -> float:
        return self.accuracy[0]

    @property
    def after(self) -> float:
        return self.accuracy[-1]


def start(
    config: Path, run_dir: Path, seed: int, threads: int, overrides: list[str]
) -> subprocess.Popen | None:
    """Start one run (None when its summary exists: a finished run is not trained again)."""
    if (run_dir / "summary.md").is_file():
        return None
    command = [sys.executable, "-m", "gspo", "train", str(config), f"seed={seed}", f"output_dir={run_dir}"]
    command += ["progress=false", "report_to=[]", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = run_dir.with_suffix(".log").open("w")
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


def train_all(args: argparse.Namespace, runs: list[Path]) -> None:
    """Train the seeds one at a time, or all at once with --parallel (a learning result, not a timing:
    the runs share the cores); each run's wall time goes to run_dir/wall_seconds."""
    batches = [list(enumerate(runs))] if args.parallel else [[(s, r)] for s, r in enumerate(runs)]
    for batch in batches:
        t0 = time.perf_counter()
        started = [(r, start(args.config, r, s, args.threads, args.overrides)) for s, r in batch]
        for run_dir, process in started:
            if process is None:
                continue
            if process.wait() != 0:
                raise SystemExit(
                    f"{run_dir} failed (exit {process.returncode}); see {run_dir.with_suffix('.log')}"
                )
            (run_dir / "wall_seconds").write_text(f"{time.perf_counter() - t0:.1f}\n")


def read_run(run_dir: Path, seed: int) -> SeedResult:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    evals = sorted((r["step"], r["accuracy"]) for r in records if r["kind"] == "eval")
    train_rows = sorted((r for r in records if r["kind"] == "train"), key=lambda r: r["step"])
    wall = run_dir / "wall_seconds"
    return SeedResult(
        seed=seed,
        steps=[s for s, _ in evals],
        accuracy=[a for _, a in evals],
        train_steps=[r["step"] for r in train_rows],
        train_length=[r["completion_len_mean"] for r in train_rows],
        time_rollout=statistics.fmean(r["time_rollout"] for r in train_rows),
        time_old_logprobs=statistics.fmean(r["time_old_logprobs"] for r in train_rows),
        time_update=statistics.fmean(r["time_update"] for r in train_rows),
        wall_minutes=float(wall.read_text()) / 60 if wall.is_file() else None,
    )


def common_steps(results: list[SeedResult]) -> list[SeedResult]:
    """Runs still in progress (--report-only) cut to the evaluations and training steps every seed has, so
    "after" compares the same step at every seed."""
    last_eval = min(r.steps[-1] for r in results)
    last_train = min(r.train_steps[-1] for r in results)
    cut = []
    for r in results:
        evals = [i for i, step in enumerate(r.steps) if step <= last_eval]
        trains = [i for i, step in enumerate(r.train_steps) if step <= last_train]
        cut.append(
            replace(
                r,
                steps=[r.steps[i] for i in evals],
                accuracy=[r.accuracy[i] for i in evals],
                train_steps=[r.train_steps[i] for i in trains],
                train_length=[r.train_length[i] for i in trains],
            )
        )
    return cut


def mean_std(values: list[float]) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} ± {spread:.3f}"


def report(results: list[SeedResult], command: str, plot: Path) -> str:
    lines = [
        f"Written by `{command}` on {cpu_name()} ({os.cpu_count()} cores; load average before / after: "
        f"{LOAD_BEFORE} / {load()}).",
        "",
        "| seed | held-out before | held-out after | mean completion tokens (first / last step) "
        "| s per rollout batch: generation / old log-probs / updates | wall minutes |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        wall = f"{r.wall_minutes:.1f}" if r.wall_minutes is not None else "-"
        lines.append(
            f"| {r.seed} | {r.before:.3f} | {r.after:.3f} | {r.train_length[0]:.0f} / {r.train_length[-1]:.0f} "
            f"| {r.time_rollout:.1f} / {r.time_old_logprobs:.1f} / {r.time_update:.1f} | {wall} |"
        )
    total = sum(r.time_rollout + r.time_old_logprobs + r.time_update for r in results)
    shares = [
        sum(getattr(r, f"time_{p}") for r in results) / total for p in ("rollout", "old_logprobs", "update")
    ]
    rise = [r.after - r.before for r in results]
    after_std = statistics.stdev(r.after for r in results) if len(results) > 1 else 0.0
    beyond = statistics.fmean(rise) > 2 * after_std
    lines += [
        "",
        f"Held-out accuracy before: {mean_std([r.before for r in results])}; after "
        f"{results[0].steps[-1]} rollout batches: {mean_std([r.after for r in results])}; rise "
        f"{mean_std(rise)}, {'beyond' if beyond else 'within'} the seed spread (2 x the std of the final "
        f"accuracy: {2 * after_std:.3f}).",
        "",
        f"Time per rollout batch, all seeds: generation {shares[0]:.0%}, old-policy log-probs {shares[1]:.0%}, "
        f"updates {shares[2]:.0%} (the trainer's time_rollout / time_old_logprobs / time_update).",
        "",
        f"![held-out accuracy and completion length per step]({plot.name})",
    ]
    return "\n".join(lines)


def draw(results: list[SeedResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for r in results:
        left.plot(r.steps, r.accuracy, alpha=0.5, label=f"seed {r.seed}")
        right.plot(r.train_steps, r.train_length, alpha=0.5, label=f"seed {r.seed}")
    if all(r.steps == results[0].steps for r in results):
        mean = [statistics.fmean(values) for values in zip(*(r.accuracy for r in results), strict=True)]
        left.plot(results[0].steps, mean, color="black", linewidth=2, label="mean")
    left.set(xlabel="rollout batch", ylabel="held-out accuracy (greedy)", title="held-out accuracy")
    right.set(xlabel="rollout batch", ylabel="tokens", title="training completion length (mean)")
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def cpu_name() -> str:
    try:
        info = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        match = re.search(r"Model name:\s*(.+)", info)
        return match.group(1).strip() if match else platform.processor()
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


LOAD_BEFORE = load()


def write_section(doc: Path, section: str) -> None:
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc} has no {BEGIN} ... {END} section to fill")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{section}\n{END}{tail}")


def summarize(run_dirs: list[Path]) -> str:
    lines = [
        "| run | held-out accuracy by step | completion tokens (first / last step) "
        "| s per rollout batch: generation / old log-probs / updates | train reward (first / last 3 steps) |",
        "|---|---|---:|---:|---:|",
    ]
    for run_dir in run_dirs:
        r = read_run(run_dir, 0)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
        rewards = [x["reward_mean"] for x in sorted(records, key=lambda x: x["step"]) if x["kind"] == "train"]
        curve = ", ".join(f"{step}: {acc:.3f}" for step, acc in zip(r.steps, r.accuracy, strict=True))
        lines.append(
            f"| {run_dir.name} | {curve} | {r.train_length[0]:.0f} / {r.train_length[-1]:.0f} "
            f"| {r.time_rollout:.1f} / {r.time_old_logprobs:.1f} / {r.time_update:.1f} "
            f"| {statistics.fmean(rewards[:3]):.3f} / {statistics.fmean(rewards[-3:]):.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "reasoning_gym.yaml")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each run")
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "reasoning_gym_seeds")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "reasoning_gym.md")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "reasoning_gym_seeds.png")
    parser.add_argument("--parallel", action="store_true", help="train all seeds at once")
    parser.add_argument("--report-only", action="store_true", help="read the run folders, train nothing")
    parser.add_argument("--summarize", type=Path, nargs="+", help="only print these run folders' figures")
    args = parser.parse_args()
    if args.summarize:
        print(summarize(args.summarize))
        return
    runs = [args.runs_dir / f"seed{seed}" for seed in range(args.seeds)]
    if not args.report_only:
        train_all(args, runs)
    results = common_steps([read_run(run_dir, seed) for seed, run_dir in enumerate(runs)])
    draw(results, args.plot)
    command = "HF_HUB_OFFLINE=1 python scripts/reasoning_gym_seeds.py " + " ".join(
        [
            f"--seeds {args.seeds}",
            f"--threads {args.threads}",
            *(["--parallel"] if args.parallel else []),
            *args.overrides,
        ]
    )
    section = report(results, command, args.plot)
    print(section)
    write_section(args.doc, section)


if __name__ == "__main__":
    main()
