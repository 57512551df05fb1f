"""The GSPO family side by side on the paper study's tiny MoE task: GSPO, GRPO, GMPO, SAPO, CISPO
(docs/bakeoff.md).

A learning-rate sweep stated up front (every method at each rate, one seed kept out of the comparison), each
method then at the rate with its highest sweep reward, the same seeds, prompts and budget for all; a table
of per-seed numbers (summary.json), verdicts against GSPO with the seeds' noise, plots.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from experiments import moe_task, paper, plots, report, runs
from experiments.moe_task import Spec
from experiments.summary import fmt, mean, noise, summarise

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


@dataclass(frozen=True)
class Bakeoff:
    """The experiment's size: `task` sizes the model, cold start and rollouts (experiments.moe_task)."""

    task: Spec
    seeds: tuple[int, ...] = (0, 1, 2)
    steps: int = 90
    sweep_lrs: tuple[float, ...] = (3e-4, 1e-3)
    """The learning rates swept, stated before any run: the two rates of docs/paper_reproduction.md (at
    3e-4 GRPO and GSPO learned; at 1e-3 GRPO degraded), so each method can show whether it tolerates the
    larger step."""
    sweep_seed: int = 100
    sweep_steps: int = 30


FULL = Bakeoff(
    task=replace(paper.FULL, prompts_per_step=8, eval_every=15, checkpoint_every=30, minibatch_split="group")
)
"""Half the paper study's rollout batch (8 prompts, not 16) and fewer steps: the whole comparison (15 runs and
a 10-run sweep) fits the hour on the 2-core CPU even while other jobs share it. Whole groups per minibatch,
as docs/bakeoff.md was made (train.minibatch_split was "group" by default then)."""
REDUCED = Bakeoff(
    task=replace(paper.REDUCED, eval_every=2, minibatch_split="group"),
    seeds=(0,),
    steps=2,
    sweep_lrs=(1e-3,),
    sweep_steps=1,
)

KEYS = (
    "reward_first",
    "reward_last",
    "accuracy_start",
    "accuracy_end",
    "accuracy_best",
    "eval_reward_end",
    "ratio_token_max_max",
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
"""summary.json's numbers per method and seed (experiments.summary: headline numbers, else step means)."""


def run_name(phase: str, method: str, lr: float, seed: int) -> str:
    return f"{phase}-{method}-lr{lr:g}-seed{seed}"


def _job(task: Spec, runs_dir: Path, phase: str, method: str, lr: float, seed: int, threads: int) -> runs.Job:
    name = run_name(phase, method, lr, seed)
    return runs.Job(moe_task.run_overrides(task, runs_dir, name, seed, lr, METHODS[method]), threads)


def sweep_jobs(bake: Bakeoff, runs_dir: Path, threads: int) -> list[runs.Job]:
    task = replace(bake.task, steps=bake.sweep_steps)
    return [
        _job(task, runs_dir, "sweep", m, lr, bake.sweep_seed, threads)
        for lr in bake.sweep_lrs
        for m in METHODS
    ]


def main_jobs(bake: Bakeoff, runs_dir: Path, rates: dict[str, float], threads: int) -> list[runs.Job]:
    task = replace(bake.task, steps=bake.steps)
    return [_job(task, runs_dir, "main", m, rates[m], seed, threads) for seed in bake.seeds for m in METHODS]


def choose_rates(bake: Bakeoff, runs_dir: Path) -> tuple[dict[str, float], dict[str, dict[float, float]]]:
    """Each method's rate: the highest sweep training reward over the last 20% of the steps (smaller on a tie)."""
    from gspo.run.metrics import read_metrics

    scores: dict[str, dict[float, float]] = {}
    for method in METHODS:
        scores[method] = {}
        for lr in bake.sweep_lrs:
            records = read_metrics(runs_dir / run_name("sweep", method, lr, bake.sweep_seed))
            scores[method][lr] = summarise([records], bake.sweep_steps, ["reward_last"])["reward_last"][0]
    chosen = {m: max(sorted(s), key=lambda lr, s=s: (round(s[lr], 6), -lr)) for m, s in scores.items()}
    return chosen, scores


@dataclass(frozen=True)
class Comparison:
    """One method against GSPO on one outcome."""

    method: str
    metric: str
    verdict: str
    evidence: str


def verdicts(table: dict[str, dict[str, list[float]]]) -> list[Comparison]:
    """Each method against GSPO, the library's default, on the outcome metrics."""
    out = []
    for method in METHODS:
        if method == "gspo":
            continue
        for key, name in (
            ("accuracy_end", "final held-out accuracy"),
            ("reward_last", "training reward, last 20%"),
        ):
            diff = mean(table[method][key]) - mean(table["gspo"][key])
            tol = noise(table[method][key], table["gspo"][key])
            verdict = "better" if diff > tol else "worse" if diff < -tol else "no difference beyond the noise"
            evidence = f"{fmt(table[method][key])} vs {fmt(table['gspo'][key])}; difference {diff:+.3f}, noise {tol:.3f}"
            out.append(Comparison(LABELS[method], name, verdict, evidence))
    return out


# ---- plots and report --------------------------------------------------------------------------------
FIGURES = [
    plots.Figure(
        "bakeoff_reward.png",
        "Held-out accuracy and reward, training reward",
        (
            plots.Panel("accuracy", "eval", "held-out greedy accuracy"),
            plots.Panel("reward_mean", "eval", "held-out mean reward"),
            plots.Panel("reward_mean", "train", "training reward (rollout batch mean)"),
        ),
    ),
    plots.Figure(
        "bakeoff_clipping.png",
        "Clipped, truncated or gated fraction (see docs/objectives.md, Metrics)",
        (
            plots.Panel("clip_frac_token", "train", "fraction of tokens", log=True),
            plots.Panel("clip_frac_seq", "train", "fraction of sequences", log=True),
        ),
    ),
    plots.Figure(
        "bakeoff_ratios.png",
        "Importance ratios over the 4 minibatches of a step",
        (
            plots.Panel("log_ratio_abs_mean", "train", "mean |log token ratio|", log=True),
            plots.Panel("ratio_token_max", "train", "max token ratio", log=True),
            plots.Panel("ratio_seq_max", "train", "max sequence ratio s_i"),
        ),
    ),
    plots.Figure(
        "bakeoff_routing.png",
        "Routing volatility (completion tokens, all MoE layers)",
        (
            plots.Panel(
                "routing_expert_change_frac_after_1_updates",
                "train",
                "activated experts changed, 1 update",
                log=True,
            ),
            plots.Panel(
                "routing_expert_change_frac", "train", "activated experts changed, 4 updates", log=True
            ),
        ),
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
"""The numbers table: (label, key, percent, digits)."""


@dataclass(frozen=True)
class Results:
    """What one invocation of the bake-off produced: the inputs of its report."""

    bake: Bakeoff
    table: dict[str, dict[str, list[float]]]
    rates: dict[str, float]
    scores: dict[str, dict[float, float]]
    sft: dict[str, Any]
    plots: list[Path]
    cost: runs.Cost
    cold_start_reused: bool


def _tables(results: Results) -> dict[str, str]:
    """The sweep, verdict and numbers tables, and the note on runs whose held-out accuracy fell."""
    bake, table, rates = results.bake, results.table, results.rates
    sweep = [
        [LABELS[m]] + [f"{results.scores[m][lr]:.3f}" for lr in bake.sweep_lrs] + [f"{rates[m]:g}"]
        for m in METHODS
    ]
    fell = [
        LABELS[m] for m in METHODS if mean(table[m]["accuracy_end"]) < mean(table[m]["accuracy_start"]) - 0.02
    ]
    return {
        "sweep": report.table(
            ["sweep: training reward, last 20%"] + [f"lr {lr:g}" for lr in bake.sweep_lrs] + ["chosen"], sweep
        ),
        "verdicts": report.table(
            ["method", "metric", "verdict", "evidence (mean ± std over seeds)"],
            [[c.method, c.metric, f"**{c.verdict}**", c.evidence] for c in verdicts(table)],
        ),
        "fell": (
            f"\n\nHeld-out accuracy ended below its start ({mean(table['gspo']['accuracy_start']):.2f}) "
            f"for {', '.join(fell)}: at this budget the runs raise the training reward but not (yet) the "
            "held-out accuracy, so the verdicts compare early training, not converged policies."
            if fell
            else ""
        ),
        "numbers": report.table(
            ["metric"] + [f"{LABELS[m]} (lr {rates[m]:g})" for m in METHODS],
            [
                [label] + [fmt(table[m][key], pct, digits) for m in METHODS]
                for label, key, pct, digits in ROWS
            ],
        ),
    }


def write_report(report_dir: Path, results: Results, *, reduced: bool, note: str, command: str) -> Path:
    """report_dir/bakeoff.md from templates/bakeoff.md; ``note``: sentences on the machine's load."""
    bake, task, sft, cost = results.bake, results.bake.task, results.sft, results.cost
    fields = {
        "flags": " --reduced" if reduced else "",
        "date": report.today(),
        "minutes": f"{cost.total_seconds / 60:.1f}",
        "cpu_minutes": f"{cost.cpu_seconds / 60:.1f}",
        "note": note,
        "parameters": f"{sft['parameters']:,}",
        "sft_steps": sft["steps"],
        "sft_eval_accuracy": f"{sft['eval_accuracy']:.2f}",
        "steps": bake.steps,
        "rollouts": f"{bake.steps * task.rollouts_per_step:,}",
        "seeds": ", ".join(map(str, bake.seeds)),
        "num_seeds": len(bake.seeds),
        "sweep_lrs": ", ".join(f"{lr:g}" for lr in bake.sweep_lrs),
        "sweep_seed": bake.sweep_seed,
        "sweep_steps": bake.sweep_steps,
        "plots": "".join(f"![{p.stem}]({p.name})\n\n" for p in results.plots),
        "command": command,
        "cold_start": (
            f"the cold start ({sft['seconds']:.0f} s) was made by an earlier invocation and reused"
            if results.cold_start_reused
            else f"cold start {sft['seconds']:.0f} s"
        ),
        "wall_per_step": f"{cost.wall_per_step:.2f}",
        "cpu_per_step": f"{cost.cpu_per_step:.2f}",
        **{k: getattr(cost, k) for k in ("workers", "threads", "runs", "steps_trained")},
        **{k: getattr(task, k) for k in ("layers", "hidden", "experts", "top_k", "operand_max", "num_eval")},
        **{k: getattr(task, k) for k in ("prompts_per_step", "group_size", "minibatches")},
        **_tables(results),
    }
    path = report_dir / "bakeoff.md"
    path.write_text(report.render("bakeoff.md", fields))
    return path


def study(bake: Bakeoff, runs_dir: Path, report_dir: Path, workers: int, threads: int) -> Results:
    """Cold start, sweep, rates, the comparison's runs (each resumed or skipped where done), summary.json,
    plots: the report's inputs."""
    from gspo.run.metrics import read_metrics

    t0 = time.perf_counter()
    runs_dir.mkdir(parents=True, exist_ok=True)
    report_dir.mkdir(parents=True, exist_ok=True)
    reused = (runs_dir / "cold_start" / "cold_start.json").is_file()
    sft = moe_task.cold_start(bake.task, runs_dir)
    print(f"cold start: {sft['steps']} SFT steps, held-out {sft['eval_accuracy']:.2f}", flush=True)
    done = runs.train_all(sweep_jobs(bake, runs_dir, threads), workers)
    rates, scores = choose_rates(bake, runs_dir)
    print("chosen learning rates: " + ", ".join(f"{m} {lr:g}" for m, lr in rates.items()), flush=True)
    done += runs.train_all(main_jobs(bake, runs_dir, rates, threads), workers)
    per_method = {
        m: [read_metrics(runs_dir / run_name("main", m, rates[m], s)) for s in bake.seeds] for m in METHODS
    }
    table = {m: summarise(records, bake.steps, KEYS) for m, records in per_method.items()}
    (runs_dir / "summary.json").write_text(json.dumps({"rates": rates, "table": table}, indent=1))
    row = plots.Row(None, per_method, {m: f"{LABELS[m]} (lr {rates[m]:g})" for m in METHODS})
    look = plots.Look(
        COLORS,
        bake.task.rollouts_per_step,
        max(1, bake.steps // 20),
        band_alpha=0.12,
        row_height=3.8,
        legend_size=7,
    )
    figures = plots.plot_all(report_dir, FIGURES, [row], look)
    cost = runs.Cost.of(done, t0, workers, threads)
    return Results(bake, table, rates, scores, sft, figures, cost, reused)
