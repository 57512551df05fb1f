"""The GSPO family side by side on the paper script's tiny MoE task: GSPO, GRPO, GMPO, SAPO and CISPO.

What it does (issue 13), with the machinery of scripts/reproduce_paper.py (the same model, cold start, task,
rollout sizes and run layout):
  1. the shared cold start (a ~0.45M-parameter Qwen3-MoE, SFT on sums until it answers some of them);
  2. a learning-rate sweep stated up front: every method at each of `Bakeoff.sweep_lrs`, one seed kept out of
     the comparison (`sweep_seed`), `sweep_steps` rollout batches; each method then takes the rate with the
     highest training reward over the last 20% of its sweep steps (the smaller rate on a tie);
  3. the comparison: every method at its rate, the same seeds (`seeds`), prompt order and rollout budget
     (`steps` rollout batches of 8 prompts x 8 completions, 4 minibatch updates each), paper defaults for
     every objective's knobs, seq-mean-token-mean aggregation for all, no KL, no Routing Replay;
  4. a report (markdown + PNG plots): held-out accuracy and reward over steps, clip or gate fractions, ratio
     statistics, routing volatility, and a verdict table against GSPO with the seeds' noise.

Deliberate departures from the papers: the tiny model and task of docs/paper_reproduction.md, one aggregation
for all (CISPO's paper averages over tokens; with completions of at most 4 tokens the difference is small),
a two-point learning-rate sweep.

Run:
    OMP_NUM_THREADS=1 python scripts/bakeoff.py --workers 2          # full: runs/bakeoff/ and docs/
    OMP_NUM_THREADS=1 python scripts/bakeoff.py --reduced --runs-dir /tmp/b --report-dir /tmp/b
An interrupted run continues where it stopped when started again with the same arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import multiprocessing
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reproduce_paper as paper

from gspo.config import load_config
from gspo.training.checkpoint import latest_checkpoint, load_trainer_state
from gspo.training.metrics import read_metrics
from gspo.training.trainer import Trainer

METHODS = {name: {"train.objective": name} for name in ("gspo", "grpo", "gmpo", "sapo", "cispo")}
"""Config overrides per method: each objective with its paper defaults (gspo.core.objectives.PAPER_DEFAULTS)."""
LABELS = {"gspo": "GSPO", "grpo": "GRPO", "gmpo": "GMPO", "sapo": "SAPO", "cispo": "CISPO"}
COLORS = {
    "gspo": "tab:blue",
    "grpo": "tab:red",
    "gmpo": "tab:green",
    "sapo": "tab:purple",
    "cispo": "tab:orange",
}


@dataclass
class Bakeoff:
    """The experiment's size: `task` sizes the model, cold start and rollouts (scripts/reproduce_paper.py)."""

    task: paper.Spec
    seeds: tuple[int, ...] = (0, 1, 2)
    steps: int = 90
    sweep_lrs: tuple[float, ...] = (3e-4, 1e-3)
    """The learning rates swept, stated before any run: the two rates of docs/paper_reproduction.md (at
    3e-4 GRPO and GSPO learned; at 1e-3 GRPO degraded), so each method can show whether it tolerates the
    larger step."""
    sweep_seed: int = 100
    sweep_steps: int = 30


FULL = Bakeoff(
    task=dataclasses.replace(
        paper.FULL, prompts_per_step=8, eval_every=15, checkpoint_every=30, minibatch_split="group"
    )
)
"""Half the paper script's rollout batch (8 prompts, not 16) and fewer steps: the whole comparison (15 runs and
a 10-run sweep) fits the hour on the 2-core CPU even while other jobs share it. Whole groups per minibatch,
as docs/bakeoff.md was made (train.minibatch_split was "group" by default then)."""
REDUCED = Bakeoff(
    task=dataclasses.replace(paper.REDUCED, eval_every=2, minibatch_split="group"),
    seeds=(0,),
    steps=2,
    sweep_lrs=(1e-3,),
    sweep_steps=1,
)


# ---- runs --------------------------------------------------------------------------------------------
def run_name(phase: str, method: str, lr: float, seed: int) -> str:
    return f"{phase}-{method}-lr{lr:g}-seed{seed}"


def run_one(job: tuple[paper.Spec, Path, str, str, float, int, int]) -> dict[str, Any]:
    """Train one (phase, method, lr, seed) for `task.steps`; resumes an interrupted run, skips a finished one.
    Returns its name, the steps trained now, and wall and CPU seconds (this process's CPU time)."""
    task, runs_dir, phase, method, lr, seed, threads = job
    torch.set_num_threads(threads)
    run_dir = runs_dir / run_name(phase, method, lr, seed)
    overrides = [
        *paper.base_overrides(task),
        f"seed={seed}",
        f"train.lr={lr}",
        f"model.path={runs_dir / 'cold_start' / 'model'}",
        f"output_dir={run_dir}",
        *(f"{key}={json.dumps(value)}" for key, value in METHODS[method].items()),
    ]
    checkpoint = latest_checkpoint(run_dir)
    start = load_trainer_state(checkpoint)["step"] if checkpoint is not None else 0
    t0, c0 = time.perf_counter(), time.process_time()
    if start < task.steps:
        Trainer(load_config(None, overrides), resume=run_dir if checkpoint is not None else None).run()
    return {
        "run": run_dir.name,
        "steps": task.steps - start,
        "wall": time.perf_counter() - t0,
        "cpu": time.process_time() - c0,
    }


def train_all(jobs: list[tuple], workers: int) -> list[dict[str, Any]]:
    done = []
    with contextlib.ExitStack() as stack:
        if workers == 1:
            results = map(run_one, jobs)
        else:
            pool = stack.enter_context(multiprocessing.get_context("spawn").Pool(workers, maxtasksperchild=1))
            results = pool.imap_unordered(run_one, jobs)
        for r in results:
            done.append(r)
            print(f"{r['run']}: {r['steps']} steps, {r['wall']:.0f} s wall, {r['cpu']:.0f} s CPU", flush=True)
    return done


# ---- results -----------------------------------------------------------------------------------------
SUMMARY_KEYS = (
    "clip_frac_token",
    "clip_frac_seq",
    "log_ratio_abs_mean",
    "ratio_token_max",
    "ratio_seq_max",
    "ratio_seq_min",
    "grad_norm",
    "routing_expert_change_frac_after_1_updates",
    "routing_expert_change_frac",
)


def summarise(records: list[list[dict[str, Any]]], steps: int) -> dict[str, list[float]]:
    """Per-seed values of the headline numbers of one method (the report shows mean and spread)."""
    last_from = steps - max(1, steps // 5) + 1  # the last 20% of the steps
    evals = [paper.series(r, "accuracy", "eval") for r in records]
    row = {
        "reward_first": [paper.series(r, "reward_mean").get(1, math.nan) for r in records],
        "reward_last": [paper.run_mean(r, "reward_mean", last_from) for r in records],
        "accuracy_start": [e.get(0, math.nan) for e in evals],
        "accuracy_end": [e.get(steps, math.nan) for e in evals],
        "accuracy_best": [max(e.values(), default=math.nan) for e in evals],
        "eval_reward_end": [paper.series(r, "reward_mean", "eval").get(steps, math.nan) for r in records],
        "ratio_token_max_max": [
            max(paper.series(r, "ratio_token_max").values(), default=math.nan) for r in records
        ],
    }
    row |= {key: [paper.run_mean(r, key) for r in records] for key in SUMMARY_KEYS}
    return row


def choose_rates(bake: Bakeoff, runs_dir: Path) -> tuple[dict[str, float], dict[str, dict[float, float]]]:
    """Each method's rate: the highest sweep training reward over the last 20% of the steps (smaller on a tie)."""
    scores: dict[str, dict[float, float]] = {}
    for method in METHODS:
        scores[method] = {}
        for lr in bake.sweep_lrs:
            records = read_metrics(runs_dir / run_name("sweep", method, lr, bake.sweep_seed))
            scores[method][lr] = summarise([records], bake.sweep_steps)["reward_last"][0]
    chosen = {m: max(sorted(s), key=lambda lr, s=s: (round(s[lr], 6), -lr)) for m, s in scores.items()}
    return chosen, scores


def verdicts(table: dict[str, dict[str, list[float]]]) -> list[tuple[str, str, str, str]]:
    """(method, metric, verdict, evidence) against GSPO, the library's default, for the outcome metrics."""
    out = []
    for method in METHODS:
        if method == "gspo":
            continue
        for key, name in (
            ("accuracy_end", "final held-out accuracy"),
            ("reward_last", "training reward, last 20%"),
        ):
            diff = paper.mean(table[method][key]) - paper.mean(table["gspo"][key])
            tol = paper.noise(table[method][key], table["gspo"][key])
            verdict = "better" if diff > tol else "worse" if diff < -tol else "no difference beyond the noise"
            evidence = (
                f"{paper.fmt(table[method][key])} vs {paper.fmt(table['gspo'][key])}; difference "
                f"{diff:+.3f}, noise {tol:.3f}"
            )
            out.append((LABELS[method], name, verdict, evidence))
    return out


# ---- plots and report --------------------------------------------------------------------------------
def plot(
    path: Path, title: str, panels: list[tuple[str, str, str, bool]], runs: dict, rates: dict, task
) -> Path:
    """One panel per metric, one line per method (mean over seeds, band: min to max), x = rollouts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_step, window = task.prompts_per_step * task.group_size, max(1, task.steps // 20)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.8), squeeze=False)
    for ax, (key, kind, label, log) in zip(axes[0], panels, strict=True):
        for method, per_seed in runs.items():
            x, y, lo, hi = paper.band(per_seed, key, kind, per_step, 1 if kind == "eval" else window)
            if not x:
                continue
            ax.plot(
                x,
                y,
                color=COLORS[method],
                label=f"{LABELS[method]} (lr {rates[method]:g})",
                marker="o" if kind == "eval" else None,
                ms=3,
            )
            if len(per_seed) > 1:
                ax.fill_between(x, lo, hi, color=COLORS[method], alpha=0.12, linewidth=0)
        if log:
            ax.set_yscale("symlog", linthresh=1e-3)
        ax.set_xlabel("rollouts (completions sampled)")
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


FIGURES = [
    (
        "bakeoff_reward.png",
        "Held-out accuracy and reward, training reward",
        [
            ("accuracy", "eval", "held-out greedy accuracy", False),
            ("reward_mean", "eval", "held-out mean reward", False),
            ("reward_mean", "train", "training reward (rollout batch mean)", False),
        ],
    ),
    (
        "bakeoff_clipping.png",
        "Clipped, truncated or gated fraction (see docs/objectives.md, Metrics)",
        [
            ("clip_frac_token", "train", "fraction of tokens", True),
            ("clip_frac_seq", "train", "fraction of sequences", True),
        ],
    ),
    (
        "bakeoff_ratios.png",
        "Importance ratios over the 4 minibatches of a step",
        [
            ("log_ratio_abs_mean", "train", "mean |log token ratio|", True),
            ("ratio_token_max", "train", "max token ratio", True),
            ("ratio_seq_max", "train", "max sequence ratio s_i", False),
        ],
    ),
    (
        "bakeoff_routing.png",
        "Routing volatility (completion tokens, all MoE layers)",
        [
            (
                "routing_expert_change_frac_after_1_updates",
                "train",
                "activated experts changed, 1 update",
                True,
            ),
            ("routing_expert_change_frac", "train", "activated experts changed, 4 updates", True),
        ],
    ),
]
ROWS = [
    ("training reward, first step", "reward_first", False, 3),
    ("training reward, last 20% of steps", "reward_last", False, 3),
    ("held-out accuracy, start", "accuracy_start", False, 3),
    ("held-out accuracy, end", "accuracy_end", False, 3),
    ("held-out accuracy, best eval", "accuracy_best", False, 3),
    ("held-out mean reward, end", "eval_reward_end", False, 3),
    ("clipped / truncated / gated tokens", "clip_frac_token", True, 3),
    ("clipped / truncated / gated sequences", "clip_frac_seq", True, 3),
    ("mean abs log token ratio", "log_ratio_abs_mean", False, 4),
    ("token ratio max (max over the run)", "ratio_token_max_max", False, 3),
    ("sequence ratio max (mean per step)", "ratio_seq_max", False, 4),
    ("sequence ratio min (mean per step)", "ratio_seq_min", False, 4),
    ("gradient norm before clipping (mean per update)", "grad_norm", False, 3),
    ("experts changed after 1 update", "routing_expert_change_frac_after_1_updates", True, 3),
    ("experts changed after the step's 4 updates", "routing_expert_change_frac", True, 3),
]


def write_report(
    report_dir: Path,
    bake: Bakeoff,
    table: dict,
    rates: dict,
    scores: dict,
    sft: dict,
    plots: list[Path],
    timing: dict[str, Any],
) -> Path:
    task, methods = bake.task, list(METHODS)
    lines = [
        "# The GSPO family side by side: GSPO, GRPO, GMPO, SAPO and CISPO on a tiny MoE",
        "",
        f"Written by `scripts/bakeoff.py{' --reduced' if timing['reduced'] else ''}` on {time.strftime('%Y-%m-%d')} "
        f"in {timing['total_seconds'] / 60:.1f} minutes of wall time ({timing['workers']} worker process(es) x "
        f"{timing['threads']} thread(s) on the 2-core CPU, {timing['cpu_seconds'] / 60:.1f} minutes of CPU "
        f"time in the training runs). {timing['note']}Every number below was measured in that run.",
        "",
        "## Setup",
        "",
        f"- Model, task and cold start: those of docs/paper_reproduction.md (`scripts/reproduce_paper.py`): "
        f"Qwen3-MoE, {task.layers} layers, hidden {task.hidden}, {task.experts} experts, top-{task.top_k}, "
        f"{sft['parameters']:,} parameters; sums a + b with 0 <= a, b <= {task.operand_max}; reward 1 for the "
        f"exact answer; {task.num_eval} held-out problems, greedy. Cold start: {sft['steps']} SFT steps, "
        f"held-out accuracy {sft['eval_accuracy']:.2f}, shared by every run.",
        f"- RL: {bake.steps} rollout batches per run of {task.prompts_per_step} prompts x {task.group_size} "
        f"completions = {bake.steps * task.prompts_per_step * task.group_size:,} rollouts, "
        f"{task.minibatches} minibatch updates each (AdamW, grad-norm clip 1.0, no KL), group-normalised "
        f"advantages, seq-mean-token-mean aggregation, no Routing Replay. Seeds {', '.join(map(str, bake.seeds))}: "
        "the same prompts, order and budget for every method.",
        "- Objectives at their paper defaults (gspo.core.objectives.PAPER_DEFAULTS): GSPO clip 3e-4 / 4e-4 on "
        "the sequence ratio; GRPO 0.2 / 0.27 per token; GMPO log-ratios clipped to [-0.4, 0.4] per token under "
        "a geometric mean; SAPO (token level) soft gate, temperatures 1.0 / 1.05; CISPO weight clipped to [0, 5], "
        "detached.",
        f"- Learning rate per method, from a sweep stated before any run: {', '.join(f'{lr:g}' for lr in bake.sweep_lrs)}, "
        f"seed {bake.sweep_seed} (not one of the comparison's), {bake.sweep_steps} rollout batches; the rate "
        "with the higher training reward over the sweep's last 20% of steps.",
        "",
        "| sweep: training reward, last 20% | "
        + " | ".join(f"lr {lr:g}" for lr in bake.sweep_lrs)
        + " | chosen |",
        "|---|" + "---|" * (len(bake.sweep_lrs) + 1),
    ]
    for m in methods:
        lines.append(
            f"| {LABELS[m]} | "
            + " | ".join(f"{scores[m][lr]:.3f}" for lr in bake.sweep_lrs)
            + f" | {rates[m]:g} |"
        )
    lines += [
        "",
        "## Verdicts against GSPO",
        "",
        "'Better' or 'worse' = a difference of the per-seed means larger than the noise: the standard error of "
        "the difference over seeds, at least 0.02 (two held-out problems in a hundred).",
        "",
        "| method | metric | verdict | evidence (mean ± std over seeds) |",
        "|---|---|---|---|",
    ]
    lines += [f"| {m} | {metric} | **{v}** | {e} |" for m, metric, v, e in verdicts(table)]
    fell = [
        LABELS[m]
        for m in methods
        if paper.mean(table[m]["accuracy_end"]) < paper.mean(table[m]["accuracy_start"]) - 0.02
    ]
    if fell:
        lines += [
            "",
            f"Held-out accuracy ended below its start ({paper.mean(table['gspo']['accuracy_start']):.2f}) "
            f"for {', '.join(fell)}: at this budget the runs raise the training reward but not (yet) the "
            "held-out accuracy, so the verdicts compare early training, not converged policies.",
        ]
    lines += [
        "",
        "## Numbers (mean ± std over seeds; per-step metrics averaged over all steps)",
        "",
        "| metric | " + " | ".join(f"{LABELS[m]} (lr {rates[m]:g})" for m in methods) + " |",
        "|---|" + "---|" * len(methods),
    ]
    for label, key, percent, digits in ROWS:
        lines.append(
            f"| {label} | " + " | ".join(paper.fmt(table[m][key], percent, digits) for m in methods) + " |"
        )
    lines += [
        "",
        "What 'clipped' counts differs by objective (docs/objectives.md, Metrics): GSPO and GRPO count where the "
        "clip zeroes the gradient; GMPO the tokens whose log-ratio is clipped; SAPO where its gate keeps less "
        "than half of the gradient weight; CISPO where the weight is truncated (the token keeps a gradient).",
        "",
        "## Plots",
        "",
        "Lines are means over seeds of each seed's moving average; bands span the seeds.",
        "",
    ]
    lines += [f"![{p.stem}]({p.name})\n" for p in plots]
    lines += [
        "## Caveats",
        "",
        "- A 0.45M-parameter model on sums with completions of at most 4 tokens: sequence- and token-level "
        "objectives differ least when sequences are short, and the verdicts say what this setting shows, not "
        "how the objectives compare on long reasoning traces.",
        f"- {len(bake.seeds)} seeds and a two-point learning-rate sweep on one seed: differences within the noise "
        "column are not evidence either way.",
        "- Each objective keeps its paper's knobs, tuned for other models and learning rates (GSPO's 3e-4 / "
        "4e-4 clips a large share of sequences here; SAPO's temperatures gate little at these ratios).",
        "",
        "## Cost",
        "",
        f"Command: `{timing['command']}`. {timing['total_seconds'] / 60:.1f} minutes wall for the whole command; "
        + (
            f"the cold start ({sft['seconds']:.0f} s) was made by an earlier invocation and reused"
            if timing["cold_start_reused"]
            else f"cold start {sft['seconds']:.0f} s"
        )
        + f"; {timing['runs']} training runs ({timing['steps_trained']} rollout batches trained in this "
        f"invocation): {timing['wall_per_step']:.2f} s wall and {timing['cpu_per_step']:.2f} s CPU per rollout "
        "batch and worker, evaluations and checkpoints included. Wall above CPU time means the machine was busy.",
        "",
    ]
    path = report_dir / "bakeoff.md"
    path.write_text("\n".join(lines))
    return path


# ---- main --------------------------------------------------------------------------------------------
class LoadMonitor(threading.Thread):
    """Samples the 1-minute load average every `every` seconds: how busy the machine was during the run."""

    def __init__(self, every: float = 30.0) -> None:
        super().__init__(daemon=True)
        self.every, self.samples, self.stop = every, [os.getloadavg()[0]], threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.every):
            self.samples.append(os.getloadavg()[0])

    def sentence(self) -> str:
        self.samples.append(os.getloadavg()[0])
        mean_load = sum(self.samples) / len(self.samples)
        cores = os.cpu_count() or 1
        busy = (
            f"above the {cores} cores, so other processes shared the CPU and the wall time is longer than on an "
            "idle machine"
            if mean_load > cores
            else "the machine was otherwise about idle"
        )
        return (
            f"The machine's 1-minute load average, sampled every {self.every:.0f} s, averaged {mean_load:.1f} "
            f"(max {max(self.samples):.1f}) on {cores} cores: {busy}. "
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reduced", action="store_true", help="the test-suite version (well under a minute)")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/bakeoff"), help="run folders (resumable)")
    parser.add_argument("--report-dir", type=Path, default=Path("docs"), help="where the report and PNGs go")
    parser.add_argument("--workers", type=int, default=1, help="runs trained in parallel processes")
    parser.add_argument("--note", default="", help="a sentence for the report, e.g. how busy the machine was")
    args = parser.parse_args(argv)

    bake = REDUCED if args.reduced else FULL
    t0, load = time.perf_counter(), LoadMonitor()
    load.start()
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    args.report_dir.mkdir(parents=True, exist_ok=True)
    base = load_config(None, [*paper.base_overrides(bake.task), "seed=0"])
    reused = (args.runs_dir / "cold_start" / "cold_start.json").is_file()
    sft = paper.cold_start(bake.task, args.runs_dir, base)
    print(f"cold start: {sft['steps']} SFT steps, held-out {sft['eval_accuracy']:.2f}", flush=True)
    threads = max(1, torch.get_num_threads() // args.workers)

    sweep_task = dataclasses.replace(bake.task, steps=bake.sweep_steps)
    jobs = [
        (sweep_task, args.runs_dir, "sweep", m, lr, bake.sweep_seed, threads)
        for lr in bake.sweep_lrs
        for m in METHODS
    ]
    done = train_all(jobs, args.workers)
    rates, scores = choose_rates(bake, args.runs_dir)
    print("chosen learning rates: " + ", ".join(f"{m} {lr:g}" for m, lr in rates.items()), flush=True)

    task = dataclasses.replace(bake.task, steps=bake.steps)
    jobs = [(task, args.runs_dir, "main", m, rates[m], seed, threads) for seed in bake.seeds for m in METHODS]
    done += train_all(jobs, args.workers)

    runs = {
        m: [read_metrics(args.runs_dir / run_name("main", m, rates[m], s)) for s in bake.seeds]
        for m in METHODS
    }
    table = {m: summarise(records, bake.steps) for m, records in runs.items()}
    (args.runs_dir / "summary.json").write_text(json.dumps({"rates": rates, "table": table}, indent=1))
    plots = [
        plot(args.report_dir / name, title, panels, runs, rates, task) for name, title, panels in FIGURES
    ]
    trained = sum(r["steps"] for r in done)
    timing = {
        "total_seconds": time.perf_counter() - t0,
        "workers": args.workers,
        "threads": threads,
        "reduced": args.reduced,
        "steps_trained": trained,
        "runs": len(done),
        "note": load.sentence() + (f"{args.note.strip()} " if args.note.strip() else ""),
        "cpu_seconds": sum(r["cpu"] for r in done),
        "cold_start_reused": reused,
        "command": f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} python scripts/bakeoff.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "wall_per_step": sum(r["wall"] for r in done) / max(1, trained),
        "cpu_per_step": sum(r["cpu"] for r in done) / max(1, trained),
    }
    report = write_report(args.report_dir, bake, table, rates, scores, sft, plots, timing)
    print(
        f"report: {report} ({timing['total_seconds']:.0f} s wall, {timing['cpu_seconds']:.0f} s CPU in runs)"
    )
    for method, metric, verdict, _ in verdicts(table):
        print(f"  {method} vs GSPO, {metric}: {verdict}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
