"""Whole groups per minibatch or any samples? `train.minibatch_split` measured on two tasks, several seeds.

With "group" the 4 minibatches of a rollout batch hold whole groups (a prompt's G samples together, so the
shared-prefix layout computes each prompt once per update); with "sample" each minibatch holds a random
quarter of all samples (the layout then shares a prompt among the ~G/4 samples of it that landed there).
Both give unbiased updates; they differ in which samples each optimizer step sees together. This script
trains both on:
  * the default run (SmolLM2-135M-Instruct, single-digit sums, 40 rollout batches), seeds 0..N-1;
  * the paper-reproduction task (scripts/reproduce_paper.py: a tiny Qwen3-MoE, GRPO, GRPO + Routing
    Replay and GSPO, lr 1e-3, 300 rollout batches), seeds 0..2;
and writes docs/minibatch_split.md: held-out accuracy, training reward and clip fractions, mean and
spread over seeds, and which split the evidence favours.

Run:  HF_HUB_OFFLINE=1 python scripts/minibatch_split.py [--seeds 3] [--workers 2] [--skip-paper]
Runs are kept in runs/minibatch_split/ and a finished run is not trained again.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gspo.config.schema import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
SPLITS = ("group", "sample")
CHOICE = """`train.minibatch_split` defaults to `{default}`, by the comparisons above: minibatches of any samples had
the higher mean in {sample_ahead} of the {total} (held-out accuracy and training reward, both tasks); beyond two
standard errors: {sample_beyond} for any samples, {group_beyond} for whole groups. One optimizer step then sees
about all of the batch's prompts (a quarter of each group) instead of a quarter of its prompts (all of their
samples): presumably the gradient's spread between prompts is the larger one here. Whole groups cost less: the update
phase computes each prompt once per group, against once per minibatch that drew any of its samples, less what
the prompts share: prefix-tree rows compute a start common to several prompts (a system message, a chat
template) once per row. The last column is each run's own figure, from the code it was trained with (runs
made before the prompts' common start was shared between groups show 1.0 for whole groups; the current cost
is `benchmarks/train_step.py`'s). The prompt-cached generation and the skipped old-policy pass save the same
either way. Choose `group` when each prompt's own tokens dominate (long distinct prompts, tool outputs,
multi-turn agents: `benchmarks/train_step.py --long-prefix`), where it saves most, and the K updates of a
rollout batch still see every prompt between them; a long system prompt common to all prompts is computed
once per row with either split."""


def train_default(run_dir: Path, split: str, seed: int) -> float:
    """One default run (1 thread; skipped when its summary exists); returns its wall seconds."""
    if (run_dir / "summary.md").is_file():
        return 0.0
    t0 = time.perf_counter()
    command = [
        sys.executable,
        "-m",
        "gspo",
        "train",
        f"output_dir={run_dir}",
        f"seed={seed}",
        f"train.minibatch_split={split}",
        "checkpoint.every=0",
        "tensorboard=false",
        "progress=false",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    log = run_dir.with_suffix(".log")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - t0


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def update_cost(run_dir: Path) -> float:
    """Median over rollout batches of the update phase's computed tokens per unique token (a group's prompt
    counted once): what a split costs, independent of the machine's speed."""
    return statistics.median(
        r["update_tokens"] / r["unique_tokens"] for r in records(run_dir) if r["kind"] == "train"
    )


def default_row(run_dir: Path) -> dict[str, float]:
    rows = records(run_dir)
    evals = {r["step"]: r for r in rows if r["kind"] == "eval"}
    train = [r for r in rows if r["kind"] == "train"]
    last = max(evals)
    tail = [r for r in train if r["step"] > last - 10]
    return {
        "accuracy_end": evals[last]["accuracy"],
        "accuracy_mean_after_0": statistics.fmean(r["accuracy"] for s, r in evals.items() if s > 0),
        "eval_reward_end": evals[last]["reward_mean"],
        "train_reward_last10": statistics.fmean(r["reward_mean"] for r in tail),
        "clip_frac_token": statistics.fmean(
            r["clip_frac_token"] for r in train if r.get("clip_frac_token") is not None
        ),
        "update_per_unique": update_cost(run_dir),
    }


def stats(values: list[float]) -> str:
    mean = statistics.fmean(values)
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.3f} ± {spread:.3f}"


COMPARED: list[tuple[str, str]] = []
"""(what, which split had the higher mean: "group" / "sample", with " beyond" past 2 standard errors)."""


def favoured(group: list[float], sample: list[float], what: str) -> str:
    """Which split is better beyond the seed noise (mean difference > 2 standard errors), or neither."""
    diff = statistics.fmean(group) - statistics.fmean(sample)
    ahead = "group" if diff > 0 else "sample"
    if len(group) < 2:
        return "too few seeds"
    se = (statistics.variance(group) / len(group) + statistics.variance(sample) / len(sample)) ** 0.5
    COMPARED.append((what, ahead + (" beyond" if abs(diff) > 2 * se else "")))
    if abs(diff) <= 2 * se:
        return f"neither (difference {diff:+.3f}, 2 standard errors {2 * se:.3f})"
    return f"{'group' if diff > 0 else 'sample'} (difference {diff:+.3f}, 2 standard errors {2 * se:.3f})"


def paper(split: str, runs: Path, workers: int) -> dict:
    out = runs / f"paper-{split}"
    command = [
        sys.executable,
        str(ROOT / "scripts" / "reproduce_paper.py"),
        "--split",
        split,
        "--lrs",
        "1e-3",
        "--runs-dir",
        str(out),
        "--report-dir",
        str(out / "report"),
        "--workers",
        str(workers),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(workers), "HF_HUB_OFFLINE": "1"}
    with (runs / f"paper-{split}.log").open("w") as log:
        subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    table = json.loads((out / "summary.json").read_text())["0.001"]
    for method, row in table.items():
        row["update_per_unique"] = [update_cost(run) for run in sorted(out.glob(f"{method}-lr0.001-seed*"))]
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the default run per split")
    parser.add_argument("--workers", type=int, default=2, help="runs trained at once (one thread each)")
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "minibatch_split")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "minibatch_split.md")
    parser.add_argument("--skip-paper", action="store_true", help="only the default run")
    args = parser.parse_args()
    t0 = time.perf_counter()
    jobs = [(split, seed) for seed in range(args.seeds) for split in SPLITS]
    with ThreadPoolExecutor(args.workers) as pool:
        walls = list(
            pool.map(lambda job: train_default(args.runs_dir / f"default-{job[0]}-seed{job[1]}", *job), jobs)
        )
    default = {
        split: [default_row(args.runs_dir / f"default-{split}-seed{seed}") for seed in range(args.seeds)]
        for split in SPLITS
    }
    papers = {} if args.skip_paper else {split: paper(split, args.runs_dir, args.workers) for split in SPLITS}
    minutes = (time.perf_counter() - t0) / 60

    lines = [
        "# Minibatches of whole groups or of any samples (`train.minibatch_split`)",
        "",
        "A rollout batch of P prompts x G samples is cut into `train.minibatches` minibatches, one",
        'optimizer update each. With `"group"` a minibatch holds whole groups, so the shared-prefix layout',
        'computes each prompt once per update; with `"sample"` it holds a random share of all samples. Both',
        "are unbiased; they differ in which samples one optimizer step sees together.",
        "",
        f"Written by `HF_HUB_OFFLINE=1 python scripts/minibatch_split.py --seeds {args.seeds} --workers "
        f"{args.workers}{' --skip-paper' if args.skip_paper else ''}` in {minutes:.0f} minutes "
        f"(runs of one thread each, {args.workers} at a time; the machine may have been shared; "
        f"{sum(w > 0 for w in walls)} of the {len(walls)} default runs trained in this invocation, the others "
        "reused from --runs-dir, as were finished paper runs).",
        "",
        f"## The default run (SmolLM2-135M, 40 rollout batches, seeds 0..{args.seeds - 1}; mean ± std over seeds)",
        "",
        "| split | held-out accuracy at step 40 | mean held-out accuracy, steps 10-40 | held-out reward at 40 "
        "| training reward, last 10 steps | clip fraction (tokens) | update tokens computed per unique token |",
        "|---|---|---|---|---|---|---|",
    ]
    keys = (
        "accuracy_end",
        "accuracy_mean_after_0",
        "eval_reward_end",
        "train_reward_last10",
        "clip_frac_token",
        "update_per_unique",
    )
    for split in SPLITS:
        lines.append(f"| {split} | " + " | ".join(stats([r[k] for r in default[split]]) for k in keys) + " |")
    lines += [
        "",
        "Per seed, held-out accuracy at step 40: "
        + "; ".join(f"{split} {[round(r['accuracy_end'], 3) for r in default[split]]}" for split in SPLITS)
        + ".",
        "",
        "Favoured by the held-out accuracy at step 40: "
        + favoured(
            *([r["accuracy_end"] for r in default[s]] for s in SPLITS), "default run, held-out accuracy at 40"
        )
        + "; by the mean held-out accuracy over steps 10-40: "
        + favoured(
            *([r["accuracy_mean_after_0"] for r in default[s]] for s in SPLITS),
            "default run, mean held-out accuracy",
        )
        + "; by the training reward: "
        + favoured(
            *([r["train_reward_last10"] for r in default[s]] for s in SPLITS), "default run, training reward"
        )
        + ".",
    ]
    if papers:
        lines += [
            "",
            "## The paper-reproduction task (tiny Qwen3-MoE, lr 1e-3, 300 rollout batches, seeds 0..2)",
            "",
            "| method | split | held-out accuracy, end | best held-out accuracy | training reward, last 20% "
            "| clip fraction (tokens) | update tokens computed per unique token |",
            "|---|---|---|---|---|---|---|",
        ]
        for method in papers["group"]:
            for split in SPLITS:
                row = papers[split][method]
                lines.append(
                    f"| {method} | {split} | "
                    + " | ".join(
                        stats(row[k])
                        for k in (
                            "accuracy_end",
                            "accuracy_best",
                            "reward_last",
                            "clip_frac_token",
                            "update_per_unique",
                        )
                    )
                    + " |"
                )
        lines += [""]
        for method in papers["group"]:
            lines.append(
                f"- {method}: favoured by the held-out accuracy at the end: "
                + favoured(
                    papers["group"][method]["accuracy_end"],
                    papers["sample"][method]["accuracy_end"],
                    f"paper task, {method}, held-out accuracy",
                )
                + "; by the training reward: "
                + favoured(
                    papers["group"][method]["reward_last"],
                    papers["sample"][method]["reward_last"],
                    f"paper task, {method}, training reward",
                )
                + "."
            )

    def beyond(split: str) -> str:
        return "; ".join(what for what, ahead in COMPARED if ahead == f"{split} beyond") or "none"

    choice = CHOICE.format(
        default=TrainConfig.minibatch_split,
        sample_ahead=sum(ahead.startswith("sample") for _, ahead in COMPARED),
        total=len(COMPARED),
        sample_beyond=beyond("sample"),
        group_beyond=beyond("group"),
    )
    lines += ["", "## The default", "", choice]
    args.doc.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.doc} ({minutes:.0f} min; default-run walls {[round(w) for w in walls]} s)")


if __name__ == "__main__":
    main()
