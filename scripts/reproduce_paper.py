"""Reproduce the GSPO paper's MoE claims at small scale: GRPO vs GRPO + Routing Replay vs GSPO.

What it does (seed 002's section 3-4; arXiv 2507.18071, sections 5.1-5.3):
  1. builds a small Qwen3-MoE causal LM from a transformers config (8 experts, top-2, router weights
     renormalised like Qwen3-30B-A3B), with the character-level tokenizer of `gspo.models`;
  2. cold start: supervised fine-tuning on the training split of a sum task until its greedy accuracy
     on training problems reaches a target, so that RL starts from a non-zero reward (once, shared by all
     runs: every method and seed starts from the same weights);
  3. RL with the gspo Trainer: GRPO (clip 0.2/0.27), GRPO + Routing Replay, GSPO (3e-4/4e-4), the same
     seeds, the same rollout budget, 4 minibatches per rollout batch, the same learning rate;
  4. writes a report (markdown + PNG plots): reward and held-out accuracy vs rollouts, clip fractions by
     tokens and by sequences, ratio statistics, routing volatility, and a verdict per claim.

Deliberate departures from the paper: a ~0.3M-parameter model instead of Qwen3-30B-A3B, sums instead of
AIME/LiveCodeBench, a learning rate sized for the tiny model, no KL term, a few hundred updates. The
claims are about mechanisms (clipping, ratio noise from routing changes), which a small model can show
or fail to show; how the verdicts are decided is written in the report.

Run:
    OMP_NUM_THREADS=1 python scripts/reproduce_paper.py --reduced --runs-dir /tmp/paper --report-dir /tmp/paper
    OMP_NUM_THREADS=2 python scripts/reproduce_paper.py --workers 2     # full: runs/paper/ and docs/
The full version trains 18 runs (3 methods x 2 learning rates x 3 seeds, 300 rollout batches of 128) after
a ~1-minute cold start: measured at 0.76 s of CPU per RL step and worker (one thread, run overheads
included), i.e. about 18 * 300 * 0.76 / 2 = 34 minutes of RL on two idle cores, ~40 minutes in all
with the two workers slowing each other; on a busy machine it takes longer. Two worker processes of one
thread each use two cores better than one process with two threads: the model is too small for
intra-op threads to pay. An interrupted run continues where it stopped when started again with the same
arguments (finished runs are skipped, unfinished ones resume from their last checkpoint).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import multiprocessing
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gspo.config import Config, load_config
from gspo.models import save_model, tiny_tokenizer
from gspo.rollout.data import Example, format_prompt
from gspo.rollout.rewards import exact_answer
from gspo.rollout.samplers import generate, tokenize_prompts
from gspo.training.build import build_examples
from gspo.training.checkpoint import latest_checkpoint, load_trainer_state
from gspo.training.metrics import read_metrics
from gspo.training.trainer import Trainer

METHODS = {
    "grpo": {"train.objective": "grpo"},
    "grpo_replay": {"train.objective": "grpo", "train.routing_replay": True},
    "gspo": {"train.objective": "gspo"},
}
"""Config overrides per method; each uses its paper clip range (gspo.core.objectives.PAPER_CLIP)."""
LABELS = {"grpo": "GRPO", "grpo_replay": "GRPO + Routing Replay", "gspo": "GSPO"}
COLORS = {"grpo": "tab:red", "grpo_replay": "tab:orange", "gspo": "tab:blue"}


@dataclass
class Spec:
    """Everything that sizes the experiment; FULL and REDUCED below."""

    hidden: int = 64
    layers: int = 4
    experts: int = 8
    top_k: int = 2
    operand_max: int = 19
    """Sums a + b with 0 <= a, b <= operand_max."""
    num_eval: int = 100
    sft_batch: int = 64
    sft_lr: float = 3e-3
    sft_max_steps: int = 600
    sft_target: float = 0.3
    """Stop the cold start once greedy accuracy on (the first 100) training problems reaches this."""
    sft_check_every: int = 25
    seeds: tuple[int, ...] = (0, 1, 2)
    lrs: tuple[float, ...] = (3e-4, 1e-3)
    """RL learning rates, each run for every method and seed. Chosen before the experiment from a 30-step
    GRPO probe on seed 0 with the FULL cold start (2026-11-22): at 1e-3 held-out accuracy fell from 0.34 to
    0.11 (the regime where stability claims can show), at 3e-4 the training reward rose from 0.26 to 0.33
    (the largest probed rate where GRPO learns)."""
    steps: int = 300
    prompts_per_step: int = 16
    group_size: int = 8
    minibatches: int = 4
    eval_every: int = 20
    checkpoint_every: int = 50
    minibatch_split: str = "sample"
    """train.minibatch_split: any samples per minibatch (the default, and what docs/paper_reproduction.md ran
    with), or whole groups (their prompts computed once)."""


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


# ---- model and cold start ---------------------------------------------------------------------------
def build_model(spec: Spec, tokenizer: Any, seed: int) -> torch.nn.Module:
    """A randomly initialised Qwen3-MoE: `experts` experts, top-`top_k`, gates renormalised over the k."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden,
        intermediate_size=2 * spec.hidden,
        moe_intermediate_size=spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=spec.hidden // 4,
        num_experts=spec.experts,
        num_experts_per_tok=spec.top_k,
        norm_topk_prob=True,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen3MoeForCausalLM(config)
    model.config.use_cache = False
    return model


def greedy_accuracy(model: torch.nn.Module, tokenizer: Any, examples: list[Example]) -> float:
    prompts = [format_prompt(tokenizer, ex.prompt) for ex in examples]
    rollouts = generate(
        model, tokenizer, prompts, group_size=1, max_new_tokens=4, greedy=True, batch_size=100
    )
    rewards = exact_answer(prompts, rollouts.completions, answer=[ex.fields["answer"] for ex in examples])
    return sum(rewards) / len(rewards)


def cold_start(spec: Spec, runs_dir: Path, base: Config) -> dict[str, Any]:
    """SFT on the training split (answer tokens + EOS, the model's own load-balancing loss included),
    until greedy accuracy on training problems reaches `sft_target`; saved to runs_dir/cold_start."""
    out = runs_dir / "cold_start"
    info_path = out / "cold_start.json"
    if info_path.is_file():  # an earlier (interrupted) invocation already made it
        return json.loads(info_path.read_text())
    t0 = time.perf_counter()
    tokenizer = tiny_tokenizer()
    model = build_model(spec, tokenizer, seed=0)
    train_examples, eval_examples = build_examples(base)
    prompt_ids = tokenize_prompts(tokenizer, [format_prompt(tokenizer, ex.prompt) for ex in train_examples])
    answer_ids = [
        [*tokenizer(ex.fields["answer"], add_special_tokens=False).input_ids, tokenizer.eos_token_id]
        for ex in train_examples
    ]
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.sft_lr, betas=(0.9, 0.99))
    generator = torch.Generator().manual_seed(0)
    probe = train_examples[:100]
    history = []
    step = 0
    while True:
        if step % spec.sft_check_every == 0 or step == spec.sft_max_steps:
            model.eval()
            accuracy = greedy_accuracy(model, tokenizer, probe)
            history.append({"step": step, "train_accuracy": accuracy})
            if accuracy >= spec.sft_target or step == spec.sft_max_steps:
                break
        model.train()
        batch = torch.randint(len(train_examples), (spec.sft_batch,), generator=generator).tolist()
        rows = [prompt_ids[i] + answer_ids[i] for i in batch]
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        labels = torch.full((len(rows), width), -100)  # loss on the answer only
        for r, i in enumerate(batch):
            n, p = len(rows[r]), len(prompt_ids[i])
            input_ids[r, :n] = torch.tensor(rows[r])
            attention[r, :n] = 1
            labels[r, p:n] = torch.tensor(answer_ids[i])
        loss = model(
            input_ids=input_ids, attention_mask=attention, labels=labels, output_router_logits=True
        ).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
    model.eval()
    save_model(model, tokenizer, out / "model")
    info = {
        "steps": step,
        "train_accuracy": history[-1]["train_accuracy"],
        "eval_accuracy": greedy_accuracy(model, tokenizer, eval_examples),
        "history": history,
        "seconds": time.perf_counter() - t0,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    info_path.write_text(json.dumps(info, indent=1))
    return info


# ---- RL runs -----------------------------------------------------------------------------------------
def base_overrides(spec: Spec) -> list[str]:
    return [
        "task.name=arithmetic",
        "task.operand_min=0",
        f"task.operand_max={spec.operand_max}",
        f"task.num_train={(spec.operand_max + 1) ** 2 - spec.num_eval}",
        f"task.num_eval={spec.num_eval}",
        "rewards={exact_answer: 1.0}",
        f"rollout.prompts_per_step={spec.prompts_per_step}",
        f"rollout.group_size={spec.group_size}",
        "rollout.max_new_tokens=4",
        "rollout.temperature=1.0",
        f"train.steps={spec.steps}",
        f"train.minibatches={spec.minibatches}",
        "train.max_grad_norm=1.0",
        f"eval.every={spec.eval_every}",
        "eval.max_new_tokens=4",
        f"train.minibatch_split={spec.minibatch_split}",
        f"checkpoint.every={spec.checkpoint_every}",
        "tensorboard=false",
        "progress=false",
    ]


def run_name(method: str, lr: float, seed: int) -> str:
    return f"{method}-lr{lr:g}-seed{seed}"


def run_config(spec: Spec, runs_dir: Path, method: str, lr: float, seed: int) -> Config:
    overrides = [
        *base_overrides(spec),
        f"seed={seed}",
        f"train.lr={lr}",
        f"model.path={runs_dir / 'cold_start' / 'model'}",
        f"output_dir={runs_dir / run_name(method, lr, seed)}",
        *(f"{key}={json.dumps(value)}" for key, value in METHODS[method].items()),
    ]
    return load_config(None, overrides)


def run_one(job: tuple[Spec, Path, str, float, int, int]) -> dict[str, Any]:
    """Train one (method, lr, seed); resumes an interrupted run, skips a finished one.

    Returns the run's name, the steps trained now, and wall and CPU seconds (this process's CPU time:
    on a busy machine the wall time overstates what the run costs on an idle one).
    """
    spec, runs_dir, method, lr, seed, threads = job
    torch.set_num_threads(threads)
    config = run_config(spec, runs_dir, method, lr, seed)
    run_dir = Path(config.output_dir)
    checkpoint = latest_checkpoint(run_dir)
    start = load_trainer_state(checkpoint)["step"] if checkpoint is not None else 0
    t0, c0 = time.perf_counter(), time.process_time()
    if start < spec.steps:
        Trainer(config, resume=run_dir if checkpoint is not None else None).run()
    return {
        "run": run_dir.name,
        "steps": spec.steps - start,
        "wall": time.perf_counter() - t0,
        "cpu": time.process_time() - c0,
    }


# ---- results -----------------------------------------------------------------------------------------
Runs = dict[str, list[list[dict[str, Any]]]]
"""method -> one list of metric records per seed (runs of one learning rate)."""


def load_runs(spec: Spec, runs_dir: Path, lr: float) -> Runs:
    return {
        method: [read_metrics(runs_dir / run_name(method, lr, seed)) for seed in spec.seeds]
        for method in METHODS
    }


def series(records: list[dict[str, Any]], key: str, kind: str = "train") -> dict[int, float]:
    out = {}
    for r in records:  # a resumed run may repeat steps: the last record wins
        if r["kind"] == kind and isinstance(r.get(key), (int, float)) and math.isfinite(r[key]):
            out[r["step"]] = float(r[key])
    return out


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def spread(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def run_mean(records: list[dict[str, Any]], key: str, first: int = 1) -> float:
    """Mean of a train metric over steps >= first."""
    return mean([v for s, v in series(records, key).items() if s >= first])


def summarise(spec: Spec, runs: Runs) -> dict[str, dict[str, Any]]:
    """Per method: per-seed values of the headline numbers (the report shows mean and spread)."""
    last_from = spec.steps - max(1, spec.steps // 5) + 1  # the last 20% of the steps
    table: dict[str, dict[str, Any]] = {}
    for method, per_seed in runs.items():
        row: dict[str, list[float]] = {}

        def add(name: str, values: list[float], row: dict[str, list[float]] = row) -> None:
            row[name] = values

        add("reward_first", [series(r, "reward_mean").get(1, float("nan")) for r in per_seed])
        add("reward_last", [run_mean(r, "reward_mean", last_from) for r in per_seed])
        add("accuracy_start", [series(r, "accuracy", "eval").get(0, float("nan")) for r in per_seed])
        add("accuracy_end", [series(r, "accuracy", "eval").get(spec.steps, float("nan")) for r in per_seed])
        add("accuracy_best", [max(series(r, "accuracy", "eval").values()) for r in per_seed])
        for key in (
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
        ):
            add(key, [run_mean(r, key) for r in per_seed])
        add(
            "ratio_token_max_max",
            [max(series(r, "ratio_token_max").values(), default=float("nan")) for r in per_seed],
        )
        add(
            "ratio_token_min_min",
            [min(series(r, "ratio_token_min").values(), default=float("nan")) for r in per_seed],
        )
        table[method] = row
    return table


# ---- plots -------------------------------------------------------------------------------------------
def smooth(xs: list[int], ys: list[float], window: int) -> tuple[list[int], list[float]]:
    if window <= 1 or len(ys) < window:
        return xs, ys
    out = [mean(ys[max(0, i - window + 1) : i + 1]) for i in range(len(ys))]
    return xs, out


def band(
    per_seed: list[list[dict[str, Any]]], key: str, kind: str, rollouts_per_step: int, window: int
) -> tuple[list[int], list[float], list[float], list[float]]:
    """x (rollouts), mean over seeds, min and max over seeds, each seed smoothed first."""
    curves = [series(r, key, kind) for r in per_seed]
    steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    if not steps:
        return [], [], [], []
    smoothed = [smooth(steps, [c[s] for s in steps], window)[1] for c in curves]
    columns = list(zip(*smoothed, strict=True))
    return (
        [s * rollouts_per_step for s in steps],
        [mean(list(c)) for c in columns],
        [min(c) for c in columns],
        [max(c) for c in columns],
    )


def plot_panels(
    path: Path, title: str, panels: list[tuple[str, str, str, bool]], by_lr: dict[float, Runs], spec: Spec
) -> Path | None:
    """panels: (metric key, kind, y label, log scale), one column each; one row per learning rate; one line
    per method (mean over seeds of each seed's moving average, band: min to max over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_step = spec.prompts_per_step * spec.group_size
    window = max(1, spec.steps // 20)
    fig, axes = plt.subplots(
        len(by_lr), len(panels), figsize=(5.2 * len(panels), 3.6 * len(by_lr)), squeeze=False
    )
    drawn = False
    for row, (lr, runs) in zip(axes, by_lr.items(), strict=True):
        for ax, (key, kind, label, log) in zip(row, panels, strict=True):
            for method, per_seed in runs.items():
                x, y, lo, hi = band(per_seed, key, kind, per_step, 1 if kind == "eval" else window)
                if not x:
                    continue
                drawn = True
                marker = "o" if kind == "eval" else None
                ax.plot(x, y, color=COLORS[method], label=LABELS[method], marker=marker, ms=3)
                if len(per_seed) > 1:
                    ax.fill_between(x, lo, hi, color=COLORS[method], alpha=0.15, linewidth=0)
            if log:
                ax.set_yscale("symlog", linthresh=1e-3)
            ax.set_title(f"lr {lr:g}", fontsize=9)
            ax.set_xlabel("rollouts (completions sampled)")
            ax.set_ylabel(label, fontsize=8)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    if not drawn:
        plt.close(fig)
        return None
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def make_plots(report_dir: Path, by_lr: dict[float, Runs], spec: Spec) -> list[Path]:
    figures = [
        (
            "paper_reward.png",
            "Reward and held-out accuracy",
            [
                ("reward_mean", "train", "training reward (rollout batch mean)", False),
                ("accuracy", "eval", "held-out greedy accuracy", False),
            ],
        ),
        (
            "paper_clipping.png",
            "Clipped fraction (gradient zeroed by clipping)",
            [
                ("clip_frac_token", "train", "clipped fraction of tokens (paper's)", True),
                ("clip_frac_seq", "train", "clipped fraction of sequences", True),
            ],
        ),
        (
            "paper_ratios.png",
            "Importance ratios over the 4 minibatches of a step",
            [
                ("log_ratio_abs_mean", "train", "mean |log token ratio|", True),
                ("ratio_token_max", "train", "max token ratio", False),
                ("ratio_seq_max", "train", "max sequence ratio s_i", False),
            ],
        ),
        (
            "paper_routing.png",
            "Routing volatility (completion tokens, all MoE layers)",
            [
                (
                    "routing_expert_change_frac_after_1_updates",
                    "train",
                    "activated experts changed, 1 update",
                    True,
                ),
                ("routing_expert_change_frac", "train", "activated experts changed, 4 updates", True),
                ("routing_volatility", "train", "(token, layer) expert sets changed, 4 updates", True),
            ],
        ),
    ]
    written = []
    for name, title, panels in figures:
        path = plot_panels(report_dir / name, title, panels, by_lr, spec)
        if path is not None:
            written.append(path)
    return written


# ---- report ------------------------------------------------------------------------------------------
def fmt(values: list[float], percent: bool = False, digits: int = 3) -> str:
    m, s = mean(values), spread(values)
    if math.isnan(m):
        return "n/a"
    if percent:
        return f"{100 * m:.{max(0, digits - 1)}f}%" + (
            f" ± {100 * s:.{max(0, digits - 1)}f}" if len(values) > 1 else ""
        )
    if 0 < abs(m) < 10 ** -(digits - 1):  # e.g. a min token ratio of 3e-5: significant digits
        return f"{m:.2g}" + (f" ± {s:.2g}" if len(values) > 1 else "")
    return f"{m:.{digits}f}" + (f" ± {s:.{digits}f}" if len(values) > 1 else "")


def noise(a: list[float], b: list[float]) -> float:
    """Standard error of the difference of two per-seed means (0.02 at least: 2 eval problems in 100)."""
    se = math.sqrt(spread(a) ** 2 / max(1, len(a)) + spread(b) ** 2 / max(1, len(b)))
    return max(0.02, se)


def verdicts(table: dict[str, dict[str, list[float]]]) -> list[tuple[str, str, str]]:
    """(claim, verdict, evidence) for each claim; thresholds are stated in the evidence."""
    grpo, replay, gspo = table["grpo"], table["grpo_replay"], table["gspo"]
    out = []

    clip_g, clip_s = mean(grpo["clip_frac_token"]), mean(gspo["clip_frac_token"])
    factor = clip_s / clip_g if clip_g > 0 else math.inf
    if factor >= 30:
        verdict = "reproduced"
    elif factor > 1:
        verdict = "partly reproduced (GSPO clips more, but less than 30x more)"
    else:
        verdict = "not reproduced"
    out.append(
        (
            "GSPO clips about two orders of magnitude more tokens than GRPO (paper: ~15% vs ~0.13%).",
            verdict,
            f"clipped token fraction, mean over steps and seeds: GSPO {100 * clip_s:.3g}%, GRPO {100 * clip_g:.3g}% "
            f"(factor {factor:.3g}; 'reproduced' needs >= 30x).",
        )
    )

    for key, name in (
        ("reward_last", "training reward (last 20% of steps)"),
        ("accuracy_end", "final held-out accuracy"),
    ):
        diff = mean(gspo[key]) - mean(grpo[key])
        tol = noise(gspo[key], grpo[key])
        verdict = "reproduced" if diff >= -tol else "not reproduced"
        if diff > tol:
            verdict += " (GSPO better beyond the noise)"
        out.append(
            (
                f"Despite clipping more, GSPO learns at least as well as GRPO: {name}.",
                verdict,
                f"GSPO {fmt(gspo[key])}, GRPO {fmt(grpo[key])} (mean ± std over seeds); difference {diff:+.3f}, "
                f"noise {tol:.3f} (standard error of the difference, at least 0.02); 'at least as well' = "
                "difference >= -noise.",
            )
        )

    change = mean(grpo["routing_expert_change_frac_after_1_updates"])
    verdict = "reproduced (same order)" if 0.03 <= change <= 0.3 else "not reproduced (different order)"
    out.append(
        (
            "In an MoE model about 10% of the activated experts change after one gradient update, for the same tokens.",
            verdict,
            f"GRPO runs: {fmt(grpo['routing_expert_change_frac_after_1_updates'], percent=True)} of activated experts "
            f"(token, layer, slot) changed after one update; {fmt(grpo['routing_volatility_after_1_updates'], percent=True)} "
            f"of (token, layer) expert sets; after the 4 updates of a step "
            f"{fmt(grpo['routing_expert_change_frac'], percent=True)}. GSPO runs: "
            f"{fmt(gspo['routing_expert_change_frac_after_1_updates'], percent=True)} after one update. 'Same order' = "
            "3% to 30%. The value scales with the learning rate; ours is sized for a tiny model.",
        )
    )

    noisy, steady = mean(grpo["log_ratio_abs_mean"]), mean(replay["log_ratio_abs_mean"])
    se = math.sqrt(
        spread(grpo["log_ratio_abs_mean"]) ** 2 / len(grpo["log_ratio_abs_mean"])
        + spread(replay["log_ratio_abs_mean"]) ** 2 / len(replay["log_ratio_abs_mean"])
    )
    tol = max(se, 0.05 * steady)
    verdict = "reproduced" if noisy - steady > tol else "not reproduced"
    out.append(
        (
            "Routing changes make GRPO's token-level ratios noisier; Routing Replay removes that part.",
            verdict,
            f"mean |log token ratio|: GRPO {fmt(grpo['log_ratio_abs_mean'], digits=4)}, GRPO + Replay "
            f"{fmt(replay['log_ratio_abs_mean'], digits=4)} ('reproduced' = GRPO higher by more than {tol:.4f}: 5% "
            f"or the seeds' standard error); max token ratio (max over the run) GRPO "
            f"{fmt(grpo['ratio_token_max_max'], digits=2)}, GRPO + Replay {fmt(replay['ratio_token_max_max'], digits=2)}.",
        )
    )

    diff = mean(replay["reward_last"]) - mean(grpo["reward_last"])
    tol = noise(replay["reward_last"], grpo["reward_last"])
    verdict = (
        "reproduced"
        if diff > tol
        else "not reproduced (no difference beyond the noise)"
        if diff >= -tol
        else "not reproduced (GRPO without replay is better)"
    )
    out.append(
        (
            "GRPO on an MoE model needs Routing Replay to train well.",
            verdict,
            f"training reward, last 20% of steps: GRPO + Replay {fmt(replay['reward_last'])}, GRPO "
            f"{fmt(grpo['reward_last'])}; difference {diff:+.3f}, noise {tol:.3f}. 'Needs' = replay better "
            "by more than the noise.",
        )
    )

    diff = mean(gspo["reward_last"]) - mean(replay["reward_last"])
    tol = noise(gspo["reward_last"], replay["reward_last"])
    verdict = "reproduced" if diff >= -tol else "not reproduced"
    out.append(
        (
            "GSPO does not need Routing Replay: without it, it trains at least as well as GRPO with it.",
            verdict,
            f"training reward, last 20% of steps: GSPO {fmt(gspo['reward_last'])}, GRPO + Replay "
            f"{fmt(replay['reward_last'])}; difference {diff:+.3f}, noise {tol:.3f}.",
        )
    )
    return out


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


def write_report(
    report_dir: Path,
    spec: Spec,
    tables: dict[float, dict[str, Any]],
    sft: dict[str, Any],
    plots: list[Path],
    timing: dict[str, Any],
) -> Path:
    seeds = ", ".join(map(str, spec.seeds))
    lrs = ", ".join(f"{lr:g}" for lr in spec.lrs)
    judged = {lr: verdicts(table) for lr, table in tables.items()}
    claims = [claim for claim, _, _ in next(iter(judged.values()))]
    lines = [
        "# GSPO paper, small-scale reproduction: GRPO vs GRPO + Routing Replay vs GSPO on a tiny MoE",
        "",
        f"Written by `scripts/reproduce_paper.py{' --reduced' if timing['reduced'] else ''}` on "
        f"{time.strftime('%Y-%m-%d')} in {timing['total_seconds'] / 60:.1f} minutes ({timing['workers']} "
        f"worker process(es) x {timing['threads']} thread(s)). Every number below was measured in that run.",
        "",
        "## Setup",
        "",
        f"- Model: Qwen3-MoE built from a transformers config: {spec.layers} layers, hidden {spec.hidden}, "
        f"{spec.experts} experts per layer, top-{spec.top_k} routing with the k gates renormalised (as in "
        f"Qwen3-30B-A3B), {sft['parameters']:,} parameters, character-level tokenizer.",
        f"- Task: sums a + b with 0 <= a, b <= {spec.operand_max}, chat-formatted prompts, reward 1 for the exact "
        f"answer, else 0 ({(spec.operand_max + 1) ** 2 - spec.num_eval} training problems, {spec.num_eval} held "
        "out, greedy evaluation).",
        f"- Cold start, shared by every run: {sft['steps']} SFT steps of {spec.sft_batch} problems (lr "
        f"{spec.sft_lr}, the model's load-balancing loss on; stop at greedy accuracy {spec.sft_target} on "
        f"training problems or {spec.sft_max_steps} steps): accuracy {sft['train_accuracy']:.2f} on training "
        f"problems, {sft['eval_accuracy']:.2f} held out ({sft['seconds']:.0f} s).",
        f"- RL: {spec.steps} rollout batches per run, each {spec.prompts_per_step} prompts x {spec.group_size} "
        f"completions (temperature 1) = {spec.prompts_per_step * spec.group_size} rollouts, split into "
        f"{spec.minibatches} minibatches (one AdamW update each, grad-norm clip 1.0, no KL, no warm-up), "
        "group-normalised advantages, seq-mean-token-mean aggregation. Learning rates "
        f"{lrs} (the same for every method; why these: the `Spec.lrs` docstring in the script). Seeds {seeds}: "
        "the same seeds, prompt order and rollout budget for every method.",
        "- Methods: GRPO, clip (0.2, 0.27); GRPO + Routing Replay: the update forward passes reuse the experts "
        "the old policy chose for each token, with gates recomputed by the current router over those experts "
        "(`gspo.models.moe`); GSPO, clip (3e-4, 4e-4), without replay.",
        "- Routing volatility, on the completion tokens of each rollout batch, over all MoE layers: the old "
        "policy's top-2 expert set against the one chosen after 1 update (the second minibatch, scored after "
        "one update) and after the step's 4 updates (an extra pass over the whole batch). 'Experts changed' "
        "counts activated (token, layer, expert) choices no longer made (the paper's measure); 'expert sets "
        "changed' counts (token, layer) pairs whose set differs.",
        "",
        "## Verdicts",
        "",
        "| claim | " + " | ".join(f"lr {lr:g}" for lr in judged) + " |",
        "|---|" + "---|" * len(judged),
    ]
    for i, claim in enumerate(claims):
        lines.append(f"| {claim} | " + " | ".join(f"**{j[i][1]}**" for j in judged.values()) + " |")
    for lr, items in judged.items():
        lines += ["", f"Evidence at lr {lr:g}:", ""]
        lines += [f"- {claim} Verdict: **{verdict}**. {evidence}" for claim, verdict, evidence in items]
    for lr, table in tables.items():
        lines += [
            "",
            f"## Numbers at lr {lr:g} (mean ± std over seeds; per-step metrics averaged over all steps)",
            "",
            "| metric | " + " | ".join(LABELS[m] for m in METHODS) + " |",
            "|---|" + "---|" * len(METHODS),
        ]
        for label, key, percent, digits in TABLE_ROWS:
            lines.append(
                f"| {label} | " + " | ".join(fmt(table[m][key], percent, digits) for m in METHODS) + " |"
            )
    lines += [
        "",
        "## Plots",
        "",
        "One row per learning rate; lines are means over seeds, bands span the seeds.",
        "",
    ]
    for path in plots:
        lines += [f"![{path.stem}]({path.name})", ""]
    gspo_seq_max = {lr: mean(t["gspo"]["ratio_seq_max"]) for lr, t in tables.items()}
    lines += [
        "## Caveats",
        "",
        "- A tiny model on a toy task over a few hundred updates; the paper's claims concern a 30B MoE "
        "(48 layers, 128 experts, top-8) over thousands of updates. A verdict says what this setting shows, not "
        "whether the paper is right.",
        "- GSPO's clip range (3e-4, 4e-4) was tuned for the paper's model and learning rate. Here the largest "
        "sequence ratio of a step averages "
        + ", ".join(f"{v:.4f} at lr {lr:g}" for lr, v in gspo_seq_max.items())
        + " against the upper bound 1.0004, so the clip fractions say as much about our learning rate as "
        "about the objectives.",
        f"- Routing volatility depends on the model (the paper's: 48 layers, 128 experts, top-8; ours: "
        f"{spec.layers} layers, {spec.experts} experts, top-{spec.top_k}) and on the step size: compare the "
        "learning rates above.",
        "- The cold start is shared: seeds vary the RL sampling and minibatch order, not the initial weights.",
        "",
        "## Cost",
        "",
        f"{timing['total_seconds'] / 60:.1f} minutes in this invocation ({timing['workers']} worker(s) x "
        f"{timing['threads']} thread(s)); cold start {sft['seconds']:.0f} s; "
        f"{len(METHODS) * len(spec.seeds) * len(spec.lrs)} RL runs of {spec.steps} steps. "
        + (
            f"Per RL step, each run's start-up, evaluations, checkpoints and plots included: "
            f"{timing['wall_per_step']:.2f} s wall and {timing['cpu_per_step']:.2f} s of CPU time per worker "
            f"({timing['steps_trained']} steps trained in this invocation; wall above CPU means a busy machine)."
            if timing["steps_trained"]
            else "Every run had been trained by an earlier invocation; this one only wrote the report."
        ),
        "",
    ]
    path = report_dir / "paper_reproduction.md"
    path.write_text("\n".join(lines))
    return path


# ---- main --------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reduced", action="store_true", help="the test-suite version (well under a minute)")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/paper"), help="run folders (resumable)")
    parser.add_argument("--report-dir", type=Path, default=Path("docs"), help="where the report and PNGs go")
    parser.add_argument("--workers", type=int, default=1, help="runs trained in parallel processes")
    parser.add_argument("--seeds", type=int, nargs="+", help="override the seeds")
    parser.add_argument("--lrs", type=float, nargs="+", help="override the learning rates")
    parser.add_argument("--steps", type=int, help="override the rollout batches per run")
    parser.add_argument("--split", choices=("group", "sample"), help="override train.minibatch_split")
    args = parser.parse_args(argv)

    spec = REDUCED if args.reduced else FULL
    if args.seeds:
        spec = dataclasses.replace(spec, seeds=tuple(args.seeds))
    if args.lrs:
        spec = dataclasses.replace(spec, lrs=tuple(args.lrs))
    if args.steps:
        spec = dataclasses.replace(spec, steps=args.steps)
    if args.split:
        spec = dataclasses.replace(spec, minibatch_split=args.split)
    t0 = time.perf_counter()
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    args.report_dir.mkdir(parents=True, exist_ok=True)
    base = load_config(None, [*base_overrides(spec), "seed=0"])
    sft = cold_start(spec, args.runs_dir, base)
    print(
        f"cold start: {sft['steps']} SFT steps, train accuracy {sft['train_accuracy']:.2f}, "
        f"held-out {sft['eval_accuracy']:.2f} ({sft['seconds']:.0f} s)",
        flush=True,
    )

    # parallel runs get one share of the threads each (tiny models: processes scale better than threads)
    threads = max(1, torch.get_num_threads() // args.workers)
    jobs = [
        (spec, args.runs_dir, method, lr, seed, threads)
        for lr in spec.lrs
        for seed in spec.seeds
        for method in METHODS
    ]
    done = []
    with contextlib.ExitStack() as stack:
        if args.workers == 1:
            results = map(run_one, jobs)
        else:
            pool = stack.enter_context(
                multiprocessing.get_context("spawn").Pool(args.workers, maxtasksperchild=1)
            )
            results = pool.imap_unordered(run_one, jobs)
        for result in results:
            done.append(result)
            print(
                f"{result['run']}: {result['steps']} steps, {result['wall']:.0f} s wall, {result['cpu']:.0f} s CPU",
                flush=True,
            )

    by_lr = {lr: load_runs(spec, args.runs_dir, lr) for lr in spec.lrs}
    tables = {lr: summarise(spec, runs) for lr, runs in by_lr.items()}
    (args.runs_dir / "summary.json").write_text(
        json.dumps({f"{lr:g}": t for lr, t in tables.items()}, indent=1)
    )
    plots = make_plots(args.report_dir, by_lr, spec)
    trained = sum(r["steps"] for r in done)
    timing = {
        "total_seconds": time.perf_counter() - t0,
        "workers": args.workers,
        "threads": threads,
        "reduced": args.reduced,
        "steps_trained": trained,
        "wall_per_step": sum(r["wall"] for r in done) / max(1, trained),
        "cpu_per_step": sum(r["cpu"] for r in done) / max(1, trained),
    }
    report = write_report(args.report_dir, spec, tables, sft, plots, timing)
    print(
        f"report: {report} ({timing['total_seconds']:.0f} s; per RL step, run overheads included: "
        f"{timing['wall_per_step']:.2f} s wall, {timing['cpu_per_step']:.2f} s CPU per worker)"
    )
    for lr, table in tables.items():
        for claim, verdict, _ in verdicts(table):
            print(f"  lr {lr:g}: {verdict}: {claim}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
