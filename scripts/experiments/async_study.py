"""The learning study of docs/async.md: the default run at rollout.lag = 0, 1, 2 x seeds, for GSPO with the
decoupled correction (the default with lag > 0), GSPO with the sampler's log-probs as the old policy's
(no correction: what most peers do), GRPO (decoupled, token level), and one arm of GSPO with a bf16
`vllm serve` at lag 1. Runs one `gspo train` at a time (a finished run is skipped: the study resumes);
writes RUNS/study.json and RUNS/study.png, and prints the table.

    HF_HUB_OFFLINE=1 python scripts/experiments/async_study.py [--seeds 0 1 2] [--runs runs/async-study]
    HF_HUB_OFFLINE=1 python scripts/experiments/async_study.py --arms "gspo decoupled" --seeds 0 1 2 3 4
    HF_HUB_OFFLINE=1 python scripts/experiments/async_study.py --vllm   # the vllm_server arm (.venv-vllm)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARMS = {
    "gspo decoupled": ["train.objective=gspo"],
    "gspo, sampler log-probs as old": [
        "train.objective=gspo",
        "train.old_logprobs=sampler",
        "train.sampler_correction=none",
    ],
    "grpo decoupled": ["train.objective=grpo"],
}
# At k = 0 "auto" resolves to exactly the second arm's settings (fresh fp32 samples: the sampler's log-probs
# as the old policy's, no correction; gspo.learning.policy.update_choices): one run serves both.
SAME = {"gspo, sampler log-probs as old k=0": "gspo decoupled k=0"}
VLLM_ARM = ("gspo decoupled, vllm_server bf16", ["rollout.engine=vllm_server", "rollout.vllm.dtype=bfloat16"])


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def finished(run: Path, steps: int) -> bool:
    path = run / "metrics.jsonl"
    return path.is_file() and any(r["kind"] == "train" and r["step"] == steps for r in metrics(run))


def train(run: Path, overrides: list[str], python: str) -> None:
    command = [python, "-m", "gspo", "train", f"output_dir={run}", "checkpoint.every=0", "report_to=[]"]
    command += ["progress=false", *overrides]
    if run.exists():  # an interrupted run starts again (its folder is gspo's own)
        subprocess.run(["rm", "-rf", str(run)], check=True)
    print(" ".join(command[2:]), flush=True)
    subprocess.run(command, check=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def summary(run: Path) -> dict[str, float]:
    rows = metrics(run)
    evals = [r for r in rows if r["kind"] == "eval"]
    train_rows = [r for r in rows if r["kind"] == "train"]

    def mean(key: str) -> float:
        values = [r[key] for r in train_rows if key in r]
        return sum(values) / len(values) if values else float("nan")

    return {
        "first": evals[0]["accuracy"],
        "last": evals[-1]["accuracy"],
        "curve": [(r["step"], r["accuracy"]) for r in evals],
        "staleness_mean": mean("staleness_mean"),
        "behaviour_seq_outside_clip_frac": mean("sampler_seq_outside_clip_frac"),
        "behaviour_logprob_abs_diff": mean("sampler_logprob_abs_diff"),
        "weight_mean": mean("sampler_is_weight_mean"),
        "weight_max": max(
            (r.get("sampler_is_weight_max", float("nan")) for r in train_rows), default=float("nan")
        ),
        "truncated_frac_seq": mean("sampler_is_truncated_frac_seq"),
        "clip_frac_seq": mean("clip_frac_seq"),
        "seconds_per_batch": mean("time_rollout") + mean("time_old_logprobs") + mean("time_update"),
    }


def plot(results: dict[str, dict], path: Path) -> None:
    """One panel per arm, a line per lag: the held-out accuracy, the mean over seeds, at each evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = sorted({label.rsplit(" k=", 1)[0] for label in results})
    fig, axes = plt.subplots(1, len(arms), figsize=(4 * len(arms), 3.4), sharey=True, squeeze=False)
    for ax, arm in zip(axes[0], arms, strict=True):
        for label, runs in results.items():
            if not label.startswith(f"{arm} k="):
                continue
            curves = [dict(run["curve"]) for run in runs.values()]
            steps = sorted(curves[0])
            ax.plot(
                steps,
                [sum(c[s] for c in curves) / len(curves) for s in steps],
                marker="o",
                label=label[len(arm) + 1 :],
            )
        ax.set_title(arm, fontsize=9)
        ax.set_xlabel("rollout batch")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("held-out accuracy, mean over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lags", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "async-study")
    parser.add_argument("--vllm", action="store_true", help="also the vllm_server bf16 arm at lag 1")
    parser.add_argument("--arms", nargs="+", choices=sorted(ARMS), help="the arms to run (default: all)")
    parser.add_argument("--steps", type=int, default=40, help="train.steps of the runs (the default run's)")
    args = parser.parse_args()
    steps = args.steps
    plan = [
        (f"{arm} k={k}", [*overrides, f"rollout.lag={k}", f"train.steps={steps}"], sys.executable)
        for arm, overrides in ARMS.items()
        if args.arms is None or arm in args.arms
        for k in args.lags
    ]
    if args.vllm:
        plan.append(
            (
                f"{VLLM_ARM[0]} k=1",
                [*VLLM_ARM[1], "rollout.lag=1"],
                str(ROOT / ".venv-vllm" / "bin" / "python"),
            )
        )
    results: dict[str, dict] = {}
    for label, overrides, python in plan:
        if label in SAME and SAME[label] in results:
            results[label] = results[SAME[label]]
            continue
        for seed in args.seeds:
            name = label.replace(", ", "-").replace(" ", "_").replace("=", "") + f"-s{seed}"
            run = args.runs / name
            if not finished(run, steps):
                train(run, [*overrides, f"seed={seed}"], python)
            results.setdefault(label, {})[seed] = summary(run)
    args.runs.mkdir(parents=True, exist_ok=True)
    (args.runs / "study.json").write_text(json.dumps(results, indent=1))
    plot(results, args.runs / "study.png")
    print(f"{'arm':45} {'held-out (per seed)':28} mean  stale  outside  w_mean  w_max  trunc  s/batch")
    for label, runs in results.items():
        per_seed = " ".join(f"{r['last']:.3f}" for r in runs.values())
        mean = sum(r["last"] for r in runs.values()) / len(runs)
        first = next(iter(runs.values()))

        def avg(key: str, runs: dict = runs) -> float:
            return sum(r[key] for r in runs.values()) / len(runs)

        print(
            f"{label:45} {per_seed:28} {mean:.3f} {avg('staleness_mean'):.2f} "
            f"{avg('behaviour_seq_outside_clip_frac'):.2f} {avg('weight_mean'):.3f} {first['weight_max']:.2f} "
            f"{avg('truncated_frac_seq'):.3f} {avg('seconds_per_batch'):.2f}"
        )


if __name__ == "__main__":
    main()
