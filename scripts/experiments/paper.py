"""The paper's MoE claims at small scale: GRPO vs GRPO + Routing Replay vs GSPO (docs/paper_reproduction.md).

Every method at every learning rate and seed from the shared cold start (moe_task), the same rollout budget;
per learning rate a table of per-seed numbers (summary.json), a verdict per claim with its evidence, plots.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from experiments import moe_task, plots, report, runs
from experiments.moe_task import Spec
from experiments.summary import fmt, mean, noise, spread, summarise

METHODS = {
    "grpo": {"train.objective": "grpo"},
    "grpo_replay": {"train.objective": "grpo", "train.routing_replay": True},
    "gspo": {"train.objective": "gspo"},
}
"""Config overrides per method; each uses its paper clip range (gspo.core.objectives.PAPER_CLIP)."""
LABELS = {"grpo": "GRPO", "grpo_replay": "GRPO + Routing Replay", "gspo": "GSPO"}
COLORS = {"grpo": "tab:red", "grpo_replay": "tab:orange", "gspo": "tab:blue"}

FULL = Spec()
REDUCED = Spec(
    hidden=32,
    layers=2,
    operand_max=9,
    num_eval=20,
    sft_batch=32,
    sft_max_steps=40,
    sft_target=1.0,
    sft_check_every=40,
    seeds=(0,),
    steps=3,
    prompts_per_step=4,
    group_size=4,
    eval_every=3,
    checkpoint_every=0,
    lrs=(3e-4, 1e-3),
)
"""The test suite's size (well under a minute of training)."""

Table = dict[str, dict[str, list[float]]]
"""method -> metric -> one value per seed (the runs of one learning rate)."""

KEYS = (
    "reward_first",
    "reward_last",
    "accuracy_start",
    "accuracy_end",
    "accuracy_best",
    "clip_frac_token",
    "clip_frac_seq",
    "log_ratio_abs_mean",
    "ratio_token_max",
    "ratio_token_min",
    "ratio_seq_max",
    "ratio_seq_min",
    "routing_volatility",
    "routing_expert_change_frac",
    "routing_volatility_after_1_updates",
    "routing_expert_change_frac_after_1_updates",
    "time_rollout",
    "time_old_logprobs",
    "time_update",
    "time_routing",
    "ratio_token_max_max",
    "ratio_token_min_min",
)
"""summary.json's numbers per method and seed (experiments.summary: headline numbers, else step means)."""


def run_name(method: str, lr: float, seed: int) -> str:
    return f"{method}-lr{lr:g}-seed{seed}"


def jobs(spec: Spec, runs_dir: Path, threads: int) -> list[runs.Job]:
    """Every (lr, seed, method) run, in that order."""
    return [
        runs.Job(moe_task.run_overrides(spec, runs_dir, run_name(m, lr, seed), seed, lr, METHODS[m]), threads)
        for lr in spec.lrs
        for seed in spec.seeds
        for m in METHODS
    ]


def load_runs(spec: Spec, runs_dir: Path, lr: float) -> dict[str, list[Any]]:
    """method -> each seed's metric records at ``lr``."""
    from gspo.run.metrics import read_metrics

    return {m: [read_metrics(runs_dir / run_name(m, lr, seed)) for seed in spec.seeds] for m in METHODS}


# ---- verdicts ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Verdict:
    claim: str
    verdict: str
    evidence: str
    """The numbers behind the verdict and the threshold that decided it."""


def _clipping(grpo: dict, gspo: dict) -> Verdict:
    clip_g, clip_s = mean(grpo["clip_frac_token"]), mean(gspo["clip_frac_token"])
    factor = clip_s / clip_g if clip_g > 0 else math.inf
    if factor >= 30:
        verdict = "reproduced"
    elif factor > 1:
        verdict = "partly reproduced (GSPO clips more, but less than 30x more)"
    else:
        verdict = "not reproduced"
    return Verdict(
        "GSPO clips about two orders of magnitude more tokens than GRPO (paper: ~15% vs ~0.13%).",
        verdict,
        f"clipped token fraction, mean over steps and seeds: GSPO {100 * clip_s:.3g}%, GRPO {100 * clip_g:.3g}% "
        f"(factor {factor:.3g}; 'reproduced' needs >= 30x).",
    )


def _learns_as_well(grpo: dict, gspo: dict, key: str, name: str) -> Verdict:
    diff = mean(gspo[key]) - mean(grpo[key])
    tol = noise(gspo[key], grpo[key])
    verdict = "reproduced" if diff >= -tol else "not reproduced"
    if diff > tol:
        verdict += " (GSPO better beyond the noise)"
    return Verdict(
        f"Despite clipping more, GSPO learns at least as well as GRPO: {name}.",
        verdict,
        f"GSPO {fmt(gspo[key])}, GRPO {fmt(grpo[key])} (mean ± std over seeds); difference {diff:+.3f}, "
        f"noise {tol:.3f} (standard error of the difference, at least 0.02); 'at least as well' = "
        "difference >= -noise.",
    )


def _experts_change(grpo: dict, gspo: dict) -> Verdict:
    change = mean(grpo["routing_expert_change_frac_after_1_updates"])
    verdict = "reproduced (same order)" if 0.03 <= change <= 0.3 else "not reproduced (different order)"
    return Verdict(
        "In an MoE model about 10% of the activated experts change after one gradient update, for the same tokens.",
        verdict,
        f"GRPO runs: {fmt(grpo['routing_expert_change_frac_after_1_updates'], percent=True)} of activated experts "
        f"(token, layer, slot) changed after one update; {fmt(grpo['routing_volatility_after_1_updates'], percent=True)} "
        f"of (token, layer) expert sets; after the 4 updates of a step "
        f"{fmt(grpo['routing_expert_change_frac'], percent=True)}. GSPO runs: "
        f"{fmt(gspo['routing_expert_change_frac_after_1_updates'], percent=True)} after one update. 'Same order' = "
        "3% to 30%. The value scales with the learning rate; ours is sized for a tiny model.",
    )


def _replay_steadies_ratios(grpo: dict, replay: dict) -> Verdict:
    key = "log_ratio_abs_mean"
    noisy, steady = mean(grpo[key]), mean(replay[key])
    se = math.sqrt(spread(grpo[key]) ** 2 / len(grpo[key]) + spread(replay[key]) ** 2 / len(replay[key]))
    tol = max(se, 0.05 * steady)
    return Verdict(
        "Routing changes make GRPO's token-level ratios noisier; Routing Replay removes that part.",
        "reproduced" if noisy - steady > tol else "not reproduced",
        f"mean |log token ratio|: GRPO {fmt(grpo[key], digits=4)}, GRPO + Replay "
        f"{fmt(replay[key], digits=4)} ('reproduced' = GRPO higher by more than {tol:.4f}: 5% "
        f"or the seeds' standard error); max token ratio (max over the run) GRPO "
        f"{fmt(grpo['ratio_token_max_max'], digits=2)}, GRPO + Replay {fmt(replay['ratio_token_max_max'], digits=2)}.",
    )


def _grpo_needs_replay(grpo: dict, replay: dict) -> Verdict:
    diff = mean(replay["reward_last"]) - mean(grpo["reward_last"])
    tol = noise(replay["reward_last"], grpo["reward_last"])
    if diff > tol:
        verdict = "reproduced"
    elif diff >= -tol:
        verdict = "not reproduced (no difference beyond the noise)"
    else:
        verdict = "not reproduced (GRPO without replay is better)"
    return Verdict(
        "GRPO on an MoE model needs Routing Replay to train well.",
        verdict,
        f"training reward, last 20% of steps: GRPO + Replay {fmt(replay['reward_last'])}, GRPO "
        f"{fmt(grpo['reward_last'])}; difference {diff:+.3f}, noise {tol:.3f}. 'Needs' = replay better "
        "by more than the noise.",
    )


def _gspo_needs_no_replay(replay: dict, gspo: dict) -> Verdict:
    diff = mean(gspo["reward_last"]) - mean(replay["reward_last"])
    tol = noise(gspo["reward_last"], replay["reward_last"])
    return Verdict(
        "GSPO does not need Routing Replay: without it, it trains at least as well as GRPO with it.",
        "reproduced" if diff >= -tol else "not reproduced",
        f"training reward, last 20% of steps: GSPO {fmt(gspo['reward_last'])}, GRPO + Replay "
        f"{fmt(replay['reward_last'])}; difference {diff:+.3f}, noise {tol:.3f}.",
    )


def verdicts(table: Table) -> list[Verdict]:
    """A verdict per claim of the paper, from one learning rate's table; thresholds are in the evidence."""
    grpo, replay, gspo = table["grpo"], table["grpo_replay"], table["gspo"]
    return [
        _clipping(grpo, gspo),
        _learns_as_well(grpo, gspo, "reward_last", "training reward (last 20% of steps)"),
        _learns_as_well(grpo, gspo, "accuracy_end", "final held-out accuracy"),
        _experts_change(grpo, gspo),
        _replay_steadies_ratios(grpo, replay),
        _grpo_needs_replay(grpo, replay),
        _gspo_needs_no_replay(replay, gspo),
    ]


# ---- report ------------------------------------------------------------------------------------------
TABLE_ROWS = [
    ("training reward, first step", "reward_first", False, 3),
    ("training reward, last 20% of steps", "reward_last", False, 3),
    ("held-out accuracy, start", "accuracy_start", False, 3),
    ("held-out accuracy, end", "accuracy_end", False, 3),
    ("held-out accuracy, best eval", "accuracy_best", False, 3),
    ("clipped tokens (paper's clip fraction)", "clip_frac_token", True, 3),
    ("clipped sequences", "clip_frac_seq", True, 3),
    ("mean abs log token ratio", "log_ratio_abs_mean", False, 4),
    ("token ratio max (max over the run)", "ratio_token_max_max", False, 3),
    ("token ratio min (min over the run)", "ratio_token_min_min", False, 3),
    ("sequence ratio max (mean per step)", "ratio_seq_max", False, 4),
    ("sequence ratio min (mean per step)", "ratio_seq_min", False, 4),
    ("experts changed after 1 update", "routing_expert_change_frac_after_1_updates", True, 3),
    ("expert sets changed after 1 update", "routing_volatility_after_1_updates", True, 3),
    ("experts changed after the step's 4 updates", "routing_expert_change_frac", True, 3),
    ("expert sets changed after the step's 4 updates", "routing_volatility", True, 3),
    ("seconds per step: rollout", "time_rollout", False, 3),
    ("seconds per step: old log-probs (+ routing record)", "time_old_logprobs", False, 3),
    ("seconds per step: 4 updates", "time_update", False, 3),
    ("seconds per step: routing volatility pass", "time_routing", False, 3),
]
"""The numbers table: (label, key, percent, digits)."""

FIGURES = [
    plots.Figure(
        "paper_reward.png",
        "Reward and held-out accuracy",
        (
            plots.Panel("reward_mean", "train", "training reward (rollout batch mean)"),
            plots.Panel("accuracy", "eval", "held-out greedy accuracy"),
        ),
    ),
    plots.Figure(
        "paper_clipping.png",
        "Clipped fraction (gradient zeroed by clipping)",
        (
            plots.Panel("clip_frac_token", "train", "clipped fraction of tokens (paper's)", log=True),
            plots.Panel("clip_frac_seq", "train", "clipped fraction of sequences", log=True),
        ),
    ),
    plots.Figure(
        "paper_ratios.png",
        "Importance ratios over the 4 minibatches of a step",
        (
            plots.Panel("log_ratio_abs_mean", "train", "mean |log token ratio|", log=True),
            plots.Panel("ratio_token_max", "train", "max token ratio"),
            plots.Panel("ratio_seq_max", "train", "max sequence ratio s_i"),
        ),
    ),
    plots.Figure(
        "paper_routing.png",
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
            plots.Panel(
                "routing_volatility", "train", "(token, layer) expert sets changed, 4 updates", log=True
            ),
        ),
    ),
]


def make_plots(report_dir: Path, by_lr: dict[float, dict[str, list[Any]]], spec: Spec) -> list[Path]:
    """The figures, one row of panels per learning rate."""
    rows = [plots.Row(f"lr {lr:g}", per_method, LABELS) for lr, per_method in by_lr.items()]
    look = plots.Look(COLORS, spec.rollouts_per_step, window=max(1, spec.steps // 20))
    return plots.plot_all(report_dir, FIGURES, rows, look)


def _judged_fields(tables: dict[float, Table]) -> dict[str, str]:
    """The verdict table (a column per learning rate), the evidence and the numbers per learning rate."""
    judged = {lr: verdicts(table) for lr, table in tables.items()}
    claims = [v.claim for v in next(iter(judged.values()))]
    rows = [[claim] + [f"**{j[i].verdict}**" for j in judged.values()] for i, claim in enumerate(claims)]
    evidence = [
        f"Evidence at lr {lr:g}:\n\n"
        + "\n".join(f"- {v.claim} Verdict: **{v.verdict}**. {v.evidence}" for v in items)
        for lr, items in judged.items()
    ]
    numbers = [
        f"## Numbers at lr {lr:g} (mean ± std over seeds; per-step metrics averaged over all steps)\n\n"
        + report.table(
            ["metric"] + [LABELS[m] for m in METHODS],
            [
                [label] + [fmt(table[m][key], pct, digits) for m in METHODS]
                for label, key, pct, digits in TABLE_ROWS
            ],
        )
        for lr, table in tables.items()
    ]
    return {
        "verdicts": report.table(["claim"] + [f"lr {lr:g}" for lr in judged], rows),
        "evidence": "\n\n".join(evidence),
        "numbers": "\n\n".join(numbers),
        "gspo_seq_max": ", ".join(
            f"{mean(t['gspo']['ratio_seq_max']):.4f} at lr {lr:g}" for lr, t in tables.items()
        ),
    }


def _cost_sentence(cost: runs.Cost) -> str:
    if not cost.steps_trained:
        return "Every run had been trained by an earlier invocation; this one only wrote the report."
    return (
        f"Per RL step, each run's start-up, evaluations, checkpoints and plots included: "
        f"{cost.wall_per_step:.2f} s wall and {cost.cpu_per_step:.2f} s of CPU time per worker "
        f"({cost.steps_trained} steps trained in this invocation; wall above CPU means a busy machine)."
    )


@dataclass(frozen=True)
class Results:
    """What one invocation of the study produced: the inputs of its report."""

    spec: Spec
    tables: dict[float, Table]
    sft: dict[str, Any]
    plots: list[Path]
    cost: runs.Cost


def write_report(report_dir: Path, results: Results, *, reduced: bool) -> Path:
    """report_dir/paper_reproduction.md from templates/paper_reproduction.md (``reduced``: REDUCED's size)."""
    spec, sft, cost = results.spec, results.sft, results.cost
    fields = {
        "flags": " --reduced" if reduced else "",
        "date": report.today(),
        "minutes": f"{cost.total_seconds / 60:.1f}",
        "workers": cost.workers,
        "threads": cost.threads,
        "parameters": f"{sft['parameters']:,}",
        "sft_steps": sft["steps"],
        "sft_train_accuracy": f"{sft['train_accuracy']:.2f}",
        "sft_eval_accuracy": f"{sft['eval_accuracy']:.2f}",
        "sft_seconds": f"{sft['seconds']:.0f}",
        "num_train": spec.num_train,
        "rollouts": spec.rollouts_per_step,
        "lrs": ", ".join(f"{lr:g}" for lr in spec.lrs),
        "seeds": ", ".join(map(str, spec.seeds)),
        "plots": "".join(f"![{p.stem}]({p.name})\n\n" for p in results.plots),
        "num_runs": len(METHODS) * len(spec.seeds) * len(spec.lrs),
        "per_step": _cost_sentence(cost),
        **{f"sft_{k}": getattr(spec, f"sft_{k}") for k in ("batch", "lr", "target", "max_steps")},
        **{k: getattr(spec, k) for k in ("layers", "hidden", "experts", "top_k", "operand_max", "num_eval")},
        **{k: getattr(spec, k) for k in ("steps", "prompts_per_step", "group_size", "minibatches")},
        **_judged_fields(results.tables),
    }
    path = report_dir / "paper_reproduction.md"
    path.write_text(report.render("paper_reproduction.md", fields))
    return path


# ---- the study ---------------------------------------------------------------------------------------
def study(spec: Spec, runs_dir: Path, report_dir: Path, workers: int, threads: int) -> Results:
    """Cold start, every run (resumed or skipped where done), summary.json, plots; the report's inputs."""
    t0 = time.perf_counter()
    runs_dir.mkdir(parents=True, exist_ok=True)
    report_dir.mkdir(parents=True, exist_ok=True)
    sft = moe_task.cold_start(spec, runs_dir)
    print(
        f"cold start: {sft['steps']} SFT steps, train accuracy {sft['train_accuracy']:.2f}, "
        f"held-out {sft['eval_accuracy']:.2f} ({sft['seconds']:.0f} s)",
        flush=True,
    )
    done = runs.train_all(jobs(spec, runs_dir, threads), workers)
    by_lr = {lr: load_runs(spec, runs_dir, lr) for lr in spec.lrs}
    tables = {
        lr: {m: summarise(per_seed, spec.steps, KEYS) for m, per_seed in r.items()} for lr, r in by_lr.items()
    }
    summary = {f"{lr:g}": t for lr, t in tables.items()}
    (runs_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    figures = make_plots(report_dir, by_lr, spec)
    return Results(spec, tables, sft, figures, runs.Cost.of(done, t0, workers, threads))


def sized(reduced: bool, **changes: Any) -> Spec:
    """FULL or REDUCED with the given fields replaced (None: kept)."""
    return replace(REDUCED if reduced else FULL, **{k: v for k, v in changes.items() if v is not None})
