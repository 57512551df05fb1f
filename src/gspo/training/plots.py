"""PNG plots and a Markdown summary of a run, drawn from its ``metrics.jsonl``.

``plot_run`` draws only the known metric groups (reward and eval accuracy, clip fractions, ratio statistics,
KL, completion lengths, loss and grad norm, learning rate); a figure whose keys are all absent is skipped.
Matplotlib is imported when a plot is drawn, through its object API with the Agg canvas, so plotting
never changes the pyplot backend of a notebook that calls it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gspo.run.metrics import read_metrics
from gspo.run.paths import run_path

PLOTS_DIR = "plots"
SUMMARY_FILE = "summary.md"


@dataclass(frozen=True)
class Series:
    """One line: ``key`` of the records of ``kind``; a key ending in "/" takes every key with that prefix."""

    key: str
    kind: str = "train"
    label: str | None = None
    style: str = "-"


@dataclass(frozen=True)
class Panel:
    title: str
    series: tuple[Series, ...]
    ylabel: str = ""
    log_y: bool = False


# (file stem, panels), in the order the figures are written.
FIGURES: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    (
        "reward",
        (
            Panel(
                "Train reward",
                (Series("reward_mean", label="reward mean"), Series("reward/", style="--")),
                "reward",
            ),
            Panel(
                "Held-out eval",
                (Series("accuracy", "eval"), Series("reward_mean", "eval", "eval reward mean", "--")),
                "accuracy / reward",
            ),
        ),
    ),
    (
        "clip_fractions",
        (
            Panel(
                "Clipped tokens",
                (
                    Series("clip_frac_token", label="all"),
                    Series("clip_frac_token_low", label="low (r < 1 - eps_low)", style="--"),
                    Series("clip_frac_token_high", label="high (r > 1 + eps_high)", style=":"),
                ),
                "fraction",
            ),
            Panel(
                "Clipped sequences",
                (
                    Series("clip_frac_seq", label="all"),
                    Series("clip_frac_seq_low", label="low (s < 1 - eps_low)", style="--"),
                    Series("clip_frac_seq_high", label="high (s > 1 + eps_high)", style=":"),
                ),
                "fraction",
            ),
        ),
    ),
    (
        "ratios",
        (
            Panel(
                "Sequence ratio s_i",
                (
                    Series("ratio_seq_mean", label="mean"),
                    Series("ratio_seq_min", label="min", style="--"),
                    Series("ratio_seq_max", label="max", style="--"),
                ),
                "ratio",
            ),
            Panel(
                "Token ratio r_t",
                (
                    Series("ratio_token_mean", label="mean"),
                    Series("ratio_token_min", label="min", style="--"),
                    Series("ratio_token_max", label="max", style="--"),
                ),
                "ratio",
            ),
            Panel("|log ratio|", (Series("log_ratio_abs_mean", label="mean |log r_t|"),), "nats"),
        ),
    ),
    ("kl", (Panel("KL to reference", (Series("kl"),), "nats"),)),
    (
        "completion_lengths",
        (
            Panel(
                "Completion length",
                (Series("completion_len_mean", label="train"), Series("completion_len_mean", "eval", "eval")),
                "tokens",
            ),
            Panel("Truncated completions", (Series("truncated_frac"),), "fraction"),
        ),
    ),
    (
        "loss",
        (
            Panel("Loss", (Series("loss"),), "loss"),
            Panel("Gradient norm (before clipping)", (Series("grad_norm"),), "norm", log_y=True),
        ),
    ),
    ("lr", (Panel("Learning rate", (Series("lr"),), "lr"),)),
)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _points(records: Sequence[dict[str, Any]], kind: str, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) sorted by step; a null value becomes NaN so the line shows a gap."""
    pairs = sorted(
        (r["step"], float(r[key]) if r[key] is not None else math.nan)
        for r in records
        if r.get("kind") == kind and key in r
    )
    return [s for s, _ in pairs], [v for _, v in pairs]


def _expand(series: Series, records: Sequence[dict[str, Any]]) -> list[tuple[str, Series]]:
    """(key, series) for each concrete key of ``series`` that has at least one finite value."""
    if series.key.endswith("/"):
        keys = sorted(
            {k for r in records if r.get("kind") == series.kind for k in r if k.startswith(series.key)}
        )
    else:
        keys = [series.key]
    return [
        (key, series)
        for key in keys
        if any(r.get("kind") == series.kind and _finite(r.get(key)) for r in records)
    ]


def _import_matplotlib() -> tuple[Any, Any, Any]:
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:
        raise ImportError(
            "plots need matplotlib: `pip install matplotlib` (or `pip install gspo[train]`)"
        ) from e
    return Figure, FigureCanvasAgg, MaxNLocator


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write ``run_dir/plots/<group>.png`` for each metric group present in ``metrics.jsonl``.

    Returns the written paths, in the order of ``FIGURES``.
    """
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    figures = []
    for stem, panels in FIGURES:
        present = [
            (panel, lines)
            for panel in panels
            if (lines := [x for s in panel.series for x in _expand(s, records)])
        ]
        if present:
            figures.append((stem, present))
    if not figures:
        return []

    Figure, FigureCanvasAgg, MaxNLocator = _import_matplotlib()
    out_dir = run_path(run_dir, PLOTS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, present in figures:
        fig = Figure(figsize=(5.5 * len(present), 4.0), layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(1, len(present), squeeze=False)[0]
        for ax, (panel, lines) in zip(axes, present, strict=True):
            for key, series in lines:
                steps, values = _points(records, series.kind, key)
                label = series.label or key
                marker = "o" if series.kind == "eval" or len(steps) <= 20 else None
                ax.plot(steps, values, series.style, marker=marker, markersize=3, label=label)
            if panel.log_y and all(
                v > 0 for k, s in lines for v in _points(records, s.kind, k)[1] if _finite(v)
            ):
                ax.set_yscale("log")
            ax.set_title(panel.title)
            ax.set_xlabel("step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylabel(panel.ylabel)
            ax.grid(alpha=0.3)
            if len(lines) > 1:
                ax.legend(fontsize="small")
        path = run_path(run_dir, PLOTS_DIR, f"{stem}.png")
        fig.savefig(path, dpi=100)
        written.append(path)
    return written


def _fmt(value: float) -> str:
    return f"{value:.4f}"


def summary_text(records: Sequence[dict[str, Any]]) -> str:
    """The Markdown summary of a run's records (see ``write_summary``)."""
    train = [r for r in records if r.get("kind") == "train"]
    evals = sorted((r for r in records if r.get("kind") == "eval"), key=lambda r: r["step"])
    lines = ["# Run summary", ""]
    if not records:
        return "\n".join([*lines, "No metrics logged.", ""])

    steps = sorted({r["step"] for r in train})
    # a step is a rollout batch (gspo train) or a train call (gspo serve): the README's words for them
    trained = "- Rollout batches (or gspo serve train calls) trained"
    lines.append(f"{trained}: {len(steps)}, steps {steps[0]} to {steps[-1]}" if steps else f"{trained}: 0")

    accuracy = [(r["step"], r["accuracy"]) for r in evals if _finite(r.get("accuracy"))]
    if accuracy:
        (first_step, first), (last_step, last) = accuracy[0], accuracy[-1]
        best_step, best = max(accuracy, key=lambda p: (p[1], -p[0]))
        lines.append(
            f"- Eval accuracy: first {_fmt(first)} (step {first_step}), "
            f"last {_fmt(last)} (step {last_step}), "
            f"best {_fmt(best)} (step {best_step}), change {last - first:+.4f}"
        )
    else:
        lines.append("- Eval accuracy: no eval lines" if not evals else "- Eval accuracy: not logged")

    reward = sorted((r["step"], r["reward_mean"]) for r in train if _finite(r.get("reward_mean")))
    if reward:
        lines.append(
            f"- Train reward mean: first {_fmt(reward[0][1])} (step {reward[0][0]}), "
            f"last {_fmt(reward[-1][1])} (step {reward[-1][0]})"
        )

    clip_keys = sorted({k for r in train for k in r if k.startswith("clip_frac_")})
    clip_means = []
    for key in clip_keys:
        values = [r[key] for r in train if _finite(r.get(key))]
        if values:
            clip_means.append(f"{key} {_fmt(sum(values) / len(values))}")
    if clip_means:
        lines.append(
            f"- Clip fractions, mean over steps (of the samples the updates computed): {', '.join(clip_means)}"
        )
    skipped = [r["skipped_samples_frac"] for r in train if _finite(r.get("skipped_samples_frac"))]
    if skipped and any(skipped):
        tokens = [r["skipped_tokens_frac"] for r in train if _finite(r.get("skipped_tokens_frac"))]
        lines.append(
            f"- Zero-advantage samples left out of the updates (train.skip_zero_advantage), mean over steps: "
            f"{_fmt(sum(skipped) / len(skipped))} of the samples, {_fmt(sum(tokens) / max(len(tokens), 1))} "
            "of their tokens"
        )

    time_keys = sorted({k for r in records for k in r if k.startswith("time_")})
    phase_totals = {k: sum(r[k] for r in records if _finite(r.get(k))) for k in time_keys}
    if phase_totals:
        phases = ", ".join(f"{k.removeprefix('time_')} {v:.1f} s" for k, v in phase_totals.items())
        lines.append(f"- Total time: {sum(phase_totals.values()):.1f} s ({phases})")
    return "\n".join([*lines, ""])


def write_summary(run_dir: str | Path) -> str:
    """Write ``run_dir/summary.md``: number of steps, first/last/best eval accuracy, first/last train
    reward, mean clip fractions and total time (sum of the ``time_*`` metrics); returns the text."""
    run_dir = Path(run_dir)
    text = summary_text(read_metrics(run_dir))
    run_path(run_dir, SUMMARY_FILE).write_text(text, encoding="utf-8")
    return text
