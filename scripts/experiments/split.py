"""Whole groups per minibatch or any samples: `train.minibatch_split` on two tasks, several seeds
(docs/minibatch_split.md).

Both splits train the default run (SmolLM2-135M-Instruct, single-digit sums, 40 rollout batches) at seeds
0..N-1, and the paper study's task (experiments.paper: GRPO, GRPO + Routing Replay and GSPO at lr 1e-3, 300
rollout batches, seeds 0..2); the report gives held-out accuracy, training reward, clip fractions and each
split's update cost, mean and spread over seeds, and which split the evidence favours.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

from experiments import paper, report, runs
from experiments.summary import Records

SPLITS = ("group", "sample")
DEFAULT_KEYS = (
    "accuracy_end",
    "accuracy_mean_after_0",
    "eval_reward_end",
    "train_reward_last10",
    "clip_frac_token",
    "update_per_unique",
)
PAPER_KEYS = ("accuracy_end", "accuracy_best", "reward_last", "clip_frac_token", "update_per_unique")


def default_job(runs_dir: Path, split: str, seed: int) -> runs.Job:
    """The default run (`gspo train` with no config file) at ``seed`` with ``split``, one thread."""
    overrides = (
        f"output_dir={runs_dir / f'default-{split}-seed{seed}'}",
        f"seed={seed}",
        f"train.minibatch_split={split}",
        "checkpoint.every=0",
        "report_to=[]",
        "progress=false",
    )
    return runs.Job(overrides, threads=1)


def update_cost(records: Records) -> float:
    """Median over rollout batches of the update phase's computed tokens per unique token (a group's prompt
    counted once): what a split costs, independent of the machine's speed."""
    return statistics.median(r["update_tokens"] / r["unique_tokens"] for r in records if r["kind"] == "train")


def default_row(records: Records) -> dict[str, float]:
    """One default run's numbers: held-out accuracy at the last eval and its mean after step 0, the held-out
    reward at the end, the training reward over the last 10 steps, the clip fraction, the update cost."""
    evals = {r["step"]: r for r in records if r["kind"] == "eval"}
    train = [r for r in records if r["kind"] == "train"]
    last = max(evals)
    return {
        "accuracy_end": evals[last]["accuracy"],
        "accuracy_mean_after_0": statistics.fmean(r["accuracy"] for s, r in evals.items() if s > 0),
        "eval_reward_end": evals[last]["reward_mean"],
        "train_reward_last10": statistics.fmean(r["reward_mean"] for r in train if r["step"] > last - 10),
        "clip_frac_token": statistics.fmean(
            r["clip_frac_token"] for r in train if r.get("clip_frac_token") is not None
        ),
        "update_per_unique": update_cost(records),
    }


def stats(values: list[float]) -> str:
    mean = statistics.fmean(values)
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.3f} ± {spread:.3f}"


@dataclass(frozen=True)
class Favoured:
    """Which split one comparison favours: the one with the higher mean, beyond 2 standard errors or not."""

    what: str
    ahead: str
    beyond: bool
    text: str


def favoured(group: list[float], sample: list[float], what: str) -> Favoured | str:
    """The comparison of the splits' per-seed values (mean difference against 2 standard errors), or the
    sentence saying there are too few seeds to compare."""
    diff = statistics.fmean(group) - statistics.fmean(sample)
    if len(group) < 2:
        return "too few seeds"
    se = (statistics.variance(group) / len(group) + statistics.variance(sample) / len(sample)) ** 0.5
    beyond = abs(diff) > 2 * se
    ahead = "group" if diff > 0 else "sample"
    text = f"{ahead if beyond else 'neither'} (difference {diff:+.3f}, 2 standard errors {2 * se:.3f})"
    return Favoured(what, ahead, beyond, text)


def paper_tables(runs_dir: Path, workers: int) -> dict[str, paper.Table]:
    """The paper study at lr 1e-3 with each split (runs_dir/paper-<split>, its own report in report/), each
    method's per-seed numbers and update cost."""
    from gspo.run.metrics import read_metrics

    out = {}
    for split in SPLITS:
        spec = replace(paper.FULL, minibatch_split=split, lrs=(1e-3,))
        folder = runs_dir / f"paper-{split}"
        results = paper.study(spec, folder, folder / "report", workers, threads=1)
        paper.write_report(folder / "report", results, reduced=False)
        out[split] = results.tables[1e-3]
        for method, row in out[split].items():
            names = [paper.run_name(method, 1e-3, seed) for seed in spec.seeds]
            row["update_per_unique"] = [update_cost(read_metrics(folder / name)) for name in names]
    return out


def _text(f: Favoured | str) -> str:
    return f if isinstance(f, str) else f.text


def _default_fields(
    default: dict[str, list[dict[str, float]]],
) -> tuple[dict[str, str], list[Favoured | str]]:
    """The default run's table, per-seed accuracies and comparisons."""
    column = {k: [[r[k] for r in default[s]] for s in SPLITS] for k in DEFAULT_KEYS}
    compared = [
        favoured(*column["accuracy_end"], "default run, held-out accuracy at 40"),
        favoured(*column["accuracy_mean_after_0"], "default run, mean held-out accuracy"),
        favoured(*column["train_reward_last10"], "default run, training reward"),
    ]
    header = (
        "split | held-out accuracy at step 40 | mean held-out accuracy, steps 10-40 | held-out reward at 40"
    )
    header += (
        " | training reward, last 10 steps | clip fraction (tokens) | update tokens computed per unique token"
    )
    fields = {
        "default_table": report.table(
            header.split(" | "),
            [[s] + [stats([r[k] for r in default[s]]) for k in DEFAULT_KEYS] for s in SPLITS],
        ),
        "per_seed": "; ".join(f"{s} {[round(r['accuracy_end'], 3) for r in default[s]]}" for s in SPLITS),
        "favoured_accuracy": _text(compared[0]),
        "favoured_mean_accuracy": _text(compared[1]),
        "favoured_reward": _text(compared[2]),
    }
    return fields, compared


def _paper_section(papers: dict[str, paper.Table]) -> tuple[str, list[Favoured | str]]:
    """The paper task's section (empty without it) and its comparisons, two per method."""
    if not papers:
        return "", []
    header = "method | split | held-out accuracy, end | best held-out accuracy | training reward, last 20%"
    header += " | clip fraction (tokens) | update tokens computed per unique token"
    rows = [
        [method, split] + [stats(papers[split][method][k]) for k in PAPER_KEYS]
        for method in papers["group"]
        for split in SPLITS
    ]
    bullets, compared = [], []
    for method in papers["group"]:
        group, sample = papers["group"][method], papers["sample"][method]
        pair = [
            favoured(
                group["accuracy_end"], sample["accuracy_end"], f"paper task, {method}, held-out accuracy"
            ),
            favoured(group["reward_last"], sample["reward_last"], f"paper task, {method}, training reward"),
        ]
        compared += pair
        bullets.append(
            f"- {method}: favoured by the held-out accuracy at the end: {_text(pair[0])}; "
            f"by the training reward: {_text(pair[1])}."
        )
    title = "## The paper-reproduction task (tiny Qwen3-MoE, lr 1e-3, 300 rollout batches, seeds 0..2)"
    return f"\n\n{title}\n\n" + report.table(header.split(" | "), rows) + "\n\n" + "\n".join(
        bullets
    ), compared


@dataclass(frozen=True)
class Results:
    """What one invocation of the study produced: the inputs of its report."""

    default: dict[str, list[dict[str, float]]]
    """split -> each seed's default_row."""
    papers: dict[str, paper.Table]
    """split -> the paper study's table at lr 1e-3 (empty: skipped)."""
    trained: int
    """Default runs trained in this invocation (the others were done before)."""
    minutes: float


def write_report(doc: Path, results: Results, workers: int) -> Path:
    """``doc`` (docs/minibatch_split.md) from templates/minibatch_split.md; the comparisons decide the
    advice's counts."""
    from gspo.config.schema import TrainConfig

    fields, compared = _default_fields(results.default)
    fields["paper"], more = _paper_section(results.papers)
    compared = [c for c in compared + more if isinstance(c, Favoured)]

    def beyond(split: str) -> str:
        return "; ".join(c.what for c in compared if c.beyond and c.ahead == split) or "none"

    seeds = len(results.default["group"])
    fields |= {
        "seeds": seeds,
        "workers": workers,
        "flags": "" if results.papers else " --skip-paper",
        "minutes": f"{results.minutes:.0f}",
        "trained": results.trained,
        "total": len(SPLITS) * seeds,
        "last_seed": seeds - 1,
        "default": TrainConfig.minibatch_split,
        "sample_ahead": sum(c.ahead == "sample" for c in compared),
        "compared": len(compared),
        "sample_beyond": beyond("sample"),
        "group_beyond": beyond("group"),
    }
    doc.write_text(report.render("minibatch_split.md", fields))
    return doc


def study(runs_dir: Path, seeds: int, workers: int, skip_paper: bool) -> Results:
    """Every default run (and the paper study with each split unless ``skip_paper``), each trained or
    reused from ``runs_dir``."""
    from gspo.run.metrics import read_metrics

    t0 = time.perf_counter()
    jobs = [default_job(runs_dir, split, seed) for seed in range(seeds) for split in SPLITS]
    done = runs.train_all(jobs, workers)
    default = {
        s: [default_row(read_metrics(runs_dir / f"default-{s}-seed{seed}")) for seed in range(seeds)]
        for s in SPLITS
    }
    papers = {} if skip_paper else paper_tables(runs_dir, workers)
    return Results(default, papers, sum(d.steps > 0 for d in done), (time.perf_counter() - t0) / 60)
