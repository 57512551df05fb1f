"""PNG plots and a Markdown summary of a run, drawn from its ``metrics.jsonl``.

``plot_run`` draws only the known metric groups (reward and eval accuracy, clip fractions, ratio statistics,
KL, completion lengths, loss and grad norm, learning rate); a figure whose keys are all absent is skipped.
Matplotlib is imported when a plot is drawn, through its object API with the Agg canvas, so plotting
never changes the pyplot backend of a notebook that calls it.

Both read ``metrics.jsonl`` as a stream, one line at a time: the plotted lines keep at most `POINTS_MAX`
points each (a longer run is thinned evenly) and the summary keeps sums and extremes, so memory does not grow
with the run (`gspo plot` of 400,000 lines took 4.5 GB when every record was held).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gspo.config import Config, load_config
from gspo.files import replace_file, replacing, run_path
from gspo.run.checkpoint import checkpoint_step, latest_checkpoint
from gspo.run.metrics import iter_metrics
from gspo.training.stalls import FlatWatch

PLOTS_DIR = "plots"
SUMMARY_FILE = "summary.md"


@dataclass(frozen=True)
class Series:
    """One line: ``key`` of the records of ``kind``; a key ending in "/" takes every key with that prefix."""

    key: str
    kind: str = "train"
    label: str | None = None
    style: str = "-"
    per: str | None = None
    """Plot the key's value divided by this key's, of the same record (a share)."""


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
    (
        "groups",
        (
            Panel(
                "Flat groups, share of the groups drawn",
                (
                    Series("groups_solved", label="solved (all at the rewards' best)", per="groups_drawn"),
                    Series(
                        "groups_stuck", label="stuck (all alike, below it)", style="--", per="groups_drawn"
                    ),
                    Series("groups_agreeing", label="stuck, one answer", style=":", per="groups_drawn"),
                ),
                "share",
            ),
            Panel("Groups drawn per rollout batch", (Series("groups_drawn"),), "groups"),
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


POINTS_MAX = 5_000
"""Records of a kind plotted at least (at most twice that): a longer run is thinned to every 2nd, 4th, ...
record (a panel 5.5 inches wide at 100 dpi has 550 columns), so memory stays bounded however many lines
metrics.jsonl holds."""
PREFIX_SERIES_MAX = 32
"""Lines a "reward/" panel draws at most (one per reward function): a legend of more is unreadable."""


class Points:
    """One plotted line's points: (index of the record among its kind's, step, value); null is NaN, a gap."""

    def __init__(self) -> None:
        self.indices, self.steps, self.values = array("q"), array("q"), array("d")
        self.finite = False

    def add(self, index: int, step: int, value: Any) -> None:
        finite = _finite(value)
        self.finite = self.finite or finite
        self.indices.append(index)
        self.steps.append(step)
        self.values.append(float(value) if finite else math.nan)

    def thin(self, stride: int) -> None:
        """Keep the points of every `stride`-th record."""
        kept = [i for i, index in enumerate(self.indices) if index % stride == 0]
        self.indices = array("q", (self.indices[i] for i in kept))
        self.steps = array("q", (self.steps[i] for i in kept))
        self.values = array("d", (self.values[i] for i in kept))

    def sorted(self) -> tuple[list[int], list[float]]:
        """(steps, values) sorted by step."""
        pairs = sorted(zip(self.steps, self.values, strict=True))
        return [s for s, _ in pairs], [v for _, v in pairs]


def _wanted(kind: str, key: str) -> bool:
    """Whether some figure plots `key` of the records of `kind`."""
    return any(
        series.kind == kind
        and (key in (series.key, series.per) or (series.key.endswith("/") and key.startswith(series.key)))
        for _, panels in FIGURES
        for panel in panels
        for series in panel.series
    )


KEYS_MAX = 4096
"""Distinct metric names remembered while reading (gspo logs about 60): a file of endless new names costs
time, not memory."""


@dataclass
class Scan:
    """What the plots and the summary need of a run's records, gathered in one pass (`scan_run`)."""

    lines: dict[tuple[str, str], Points] = field(default_factory=dict)
    """The plotted lines, by (kind, key)."""
    summary: Summary = field(default_factory=lambda: Summary())
    _plans: dict[tuple[Any, ...], tuple[list[str], list[str], list[str]]] = field(default_factory=dict)
    _seen: dict[str, list[int]] = field(default_factory=dict)  # kind -> [records, stride, kept]

    def add(self, record: dict[str, Any]) -> None:
        # a run's lines share a few key sets: which keys are plotted or summed is worked out once per set
        signature = (record.get("kind"), *record)
        plan = self._plans.get(signature) or self._plan(record)
        if len(self._plans) < KEYS_MAX:
            self._plans[signature] = plan
        plotted, times, clips = plan
        self.summary.add(record, times, clips)
        if not plotted:
            return
        kind = record["kind"]
        seen = self._seen.setdefault(kind, [0, 1, 0])
        index, seen[0] = seen[0], seen[0] + 1
        if index % seen[1]:  # thinned out: every stride-th record of its kind is plotted
            return
        for key in plotted:
            self.lines.setdefault((kind, key), Points()).add(index, record["step"], record[key])
        seen[2] += 1
        if seen[2] >= 2 * POINTS_MAX:
            seen[1] *= 2
            seen[2] = len(range(0, seen[0], seen[1]))
            for (line_kind, _), points in self.lines.items():
                if line_kind == kind:
                    points.thin(seen[1])

    def _plan(self, record: dict[str, Any]) -> tuple[list[str], list[str], list[str]]:
        """(plotted keys, time keys, clip keys) of a record's key set."""
        kind = record.get("kind")
        plotted = []
        for key in record:
            rewards = sum(k.startswith("reward/") for _, k in self.lines)
            prefixed = (
                key.startswith("reward/") and (kind, key) not in self.lines and rewards >= PREFIX_SERIES_MAX
            )
            if isinstance(kind, str) and _wanted(kind, key) and not prefixed:
                plotted.append(key)
        times = [key for key in record if key.startswith("time_")]
        clips = [key for key in record if key.startswith("clip_frac_")] if kind == "train" else []
        return plotted, times, clips


def scan_run(run_dir: str | Path) -> Scan:
    """One pass over ``run_dir/metrics.jsonl``, read as a stream, for `plot_run` and `write_summary`; the
    run's config.yaml says how long a streak of flat groups is a collapse (as the run's progress said)."""
    scan = Scan(summary=Summary(watch=FlatWatch(_run_config(Path(run_dir)))))
    for record in iter_metrics(run_dir):
        scan.add(record)
    return scan


def _run_config(run_dir: Path) -> Config | None:
    """The config a run folder's config.yaml holds (read as data), or None where it cannot be read."""
    try:
        return load_config(run_dir / "config.yaml")
    except Exception:  # absent, damaged, or of another version: the summary does without it
        return None


def _expand(series: Series, lines: dict[tuple[str, str], Points]) -> list[tuple[str, Series]]:
    """(key, series) for each concrete key of ``series`` that has at least one finite value."""
    if series.key.endswith("/"):
        keys = sorted(key for kind, key in lines if kind == series.kind and key.startswith(series.key))
    else:
        keys = [series.key]
    present = [
        (key, series) for key in keys if (series.kind, key) in lines and lines[series.kind, key].finite
    ]
    return present if series.per is None or (series.kind, series.per) in lines else []


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


def plot_run(run_dir: str | Path, scan: Scan | None = None) -> list[Path]:
    """Write ``run_dir/plots/<group>.png`` for each metric group present in ``metrics.jsonl`` (``scan``:
    the file already read by `scan_run`).

    Returns the written paths, in the order of ``FIGURES``.
    """
    run_dir = Path(run_dir)
    points = (scan or scan_run(run_dir)).lines
    figures = []
    for stem, panels in FIGURES:
        present = [
            (panel, lines)
            for panel in panels
            if (lines := [x for s in panel.series for x in _expand(s, points)])
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
                steps, values = points[series.kind, key].sorted()
                if series.per is not None:  # a share: divided by the same record's value of `per`
                    per = dict(zip(*points[series.kind, series.per].sorted(), strict=True))
                    values = [
                        v / per[s] if per.get(s) else math.nan for s, v in zip(steps, values, strict=True)
                    ]
                label = series.label or key
                marker = "o" if series.kind == "eval" or len(steps) <= 20 else None
                ax.plot(steps, values, series.style, marker=marker, markersize=3, label=label)
            if panel.log_y and all(v > 0 for k, s in lines for v in points[s.kind, k].values if _finite(v)):
                ax.set_yscale("log")
            ax.set_title(panel.title)
            ax.set_xlabel("step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylabel(panel.ylabel)
            ax.grid(alpha=0.3)
            if len(lines) > 1:
                ax.legend(fontsize="small")
        path = run_path(run_dir, PLOTS_DIR, f"{stem}.png")
        with replacing(path) as tmp:
            fig.savefig(tmp, dpi=100, format="png")
        written.append(path)
    return written


def _fmt(value: float) -> str:
    return f"{value:.4f}"


@dataclass
class Summary:
    """The summary's figures, gathered one record at a time (`add`), in memory that does not grow with the
    run: counts, sums, and the first, last and best points (`text` writes them)."""

    records: int = 0
    evals: int = 0
    train_steps: int = 0
    train_range: tuple[int, int] | None = None
    last_train_step: int | None = None
    accuracy: dict[str, tuple[int, float]] = field(default_factory=dict)  # first, last, best
    reward: dict[str, tuple[int, float]] = field(default_factory=dict)  # first, last
    clip: dict[str, list[float]] = field(default_factory=dict)  # key -> [sum, count]
    skipped: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0, 0.0])  # sum, n, tokens, n, any
    times: dict[str, float] = field(default_factory=dict)
    groups: dict[str, float] = field(
        default_factory=dict
    )  # groups_* and extra_groups: sums; "steps"; "extra_max"
    watch: FlatWatch = field(default_factory=lambda: FlatWatch(None))
    notes: list[str] = field(default_factory=list)

    def add(self, record: dict[str, Any], times: Sequence[str], clips: Sequence[str]) -> None:
        """Count `record` in; `times` and `clips`: its time_* and (train) clip_frac_* keys."""
        self.records += 1
        step, kind = record["step"], record.get("kind")
        for key in times:
            if key in self.times or len(self.times) < KEYS_MAX:
                value = record[key]
                self.times[key] = self.times.get(key, 0.0) + (value if _finite(value) else 0.0)
        if kind == "eval":
            self.evals += 1
            if _finite(record.get("accuracy")):
                _extremes(self.accuracy, step, record["accuracy"], best=True)
        if kind != "train":
            return
        if step != self.last_train_step:  # a run logs each step once, in order
            self.train_steps += 1
            low, high = self.train_range or (step, step)
            self.train_range, self.last_train_step = (min(low, step), max(high, step)), step
        if _finite(record.get("reward_mean")):
            _extremes(self.reward, step, record["reward_mean"])
        for key in clips:
            if key in self.clip or len(self.clip) < KEYS_MAX:
                total = self.clip.setdefault(key, [0.0, 0.0])
                if _finite(record[key]):
                    total[0], total[1] = total[0] + record[key], total[1] + 1
        if _finite(record.get("groups_drawn")) and record["groups_drawn"] > 0:
            self.groups["steps"] = self.groups.get("steps", 0.0) + 1
            for key in ("groups_drawn", "groups_solved", "groups_stuck", "groups_agreeing", "extra_groups"):
                if _finite(record.get(key)):
                    self.groups[key] = self.groups.get(key, 0.0) + record[key]
            if _finite(record.get("extra_groups")):
                self.groups["extra_max"] = max(self.groups.get("extra_max", 0.0), record["extra_groups"])
            self.notes += self.watch.update(step, record)
        for i, key in ((0, "skipped_samples_frac"), (2, "skipped_tokens_frac")):
            if _finite(record.get(key)):
                self.skipped[i] += record[key]
                self.skipped[i + 1] += 1
                self.skipped[4] = self.skipped[4] or (i == 0 and record[key] != 0)

    def text(self) -> str:
        """The Markdown summary (see ``write_summary``)."""
        lines = ["# Run summary", ""]
        if not self.records:
            return "\n".join([*lines, "No metrics logged.", ""])
        # a step is a rollout batch (gspo train) or a train call (gspo serve): the README's words for them
        trained = f"- Rollout batches (or gspo serve train calls) trained: {self.train_steps}"
        low, high = self.train_range or (0, 0)
        lines.append(trained + (f", steps {low} to {high}" if self.train_range else ""))
        if self.accuracy:
            (first_step, first), (last_step, last) = self.accuracy["first"], self.accuracy["last"]
            best_step, best = self.accuracy["best"]
            lines.append(
                f"- Eval accuracy: first {_fmt(first)} (step {first_step}), last {_fmt(last)} (step {last_step}), "
                f"best {_fmt(best)} (step {best_step}), change {last - first:+.4f}"
            )
        else:
            lines.append(
                "- Eval accuracy: no eval lines" if not self.evals else "- Eval accuracy: not logged"
            )
        if self.reward:
            (first_step, first), (last_step, last) = self.reward["first"], self.reward["last"]
            lines.append(
                f"- Train reward mean: first {_fmt(first)} (step {first_step}), last {_fmt(last)} (step {last_step})"
            )
        means = [f"{key} {_fmt(total / n)}" for key, (total, n) in sorted(self.clip.items()) if n]
        if means:
            lines.append(
                f"- Clip fractions, mean over steps (of the samples the updates computed): {', '.join(means)}"
            )
        samples, n, tokens, n_tokens, any_skipped = self.skipped
        if n and any_skipped:
            lines.append(
                f"- Zero-advantage samples left out of the updates (train.skip_zero_advantage), mean over steps: "
                f"{_fmt(samples / n)} of the samples, {_fmt(tokens / max(n_tokens, 1))} of their tokens"
            )
        lines += self.group_lines()
        if self.times:
            phases = ", ".join(f"{k.removeprefix('time_')} {v:.1f} s" for k, v in sorted(self.times.items()))
            lines.append(f"- Total time: {sum(self.times.values()):.1f} s ({phases})")
        return "\n".join([*lines, ""])

    def group_lines(self) -> list[str]:
        """The flat groups (every completion scored alike), of the groups drawn, mean over steps; dynamic
        sampling's extra groups; the collapse or saturation the run's lines showed, with the step it began."""
        g = self.groups
        if not g.get("groups_drawn"):
            return []
        share = {
            key: g.get(key, 0.0) / g["groups_drawn"]
            for key in ("groups_solved", "groups_stuck", "groups_agreeing")
        }
        lines = [
            f"- Flat groups (every completion scored alike), share of the groups drawn over the run: solved (at the "
            f"rewards' best) {_fmt(share['groups_solved'])}, stuck (below it) {_fmt(share['groups_stuck'])}, of "
            f"which agreeing on one answer {_fmt(share['groups_agreeing'])}"
        ]
        if "extra_groups" in g:
            lines.append(
                f"- Dynamic sampling: extra groups drawn per rollout batch, mean {g['extra_groups'] / g['steps']:.2f}, "
                f"most {g.get('extra_max', 0.0):.0f}"
            )
        for note in self.notes:
            kind, _, text = note.partition(": ")
            lines.append(f"- {text[0].upper()}{text[1:]}" if kind in ("warning", "note") else f"- {note}")
        return lines


def _extremes(points: dict[str, tuple[int, float]], step: int, value: float, *, best: bool = False) -> None:
    """Keep the first (lowest step), last (highest step) and, with `best`, the best (highest value, earliest
    step) of a series of points."""
    if "first" not in points or step < points["first"][0]:
        points["first"] = (step, value)
    if "last" not in points or step >= points["last"][0]:
        points["last"] = (step, value)
    if best and ("best" not in points or (value, -step) > (points["best"][1], -points["best"][0])):
        points["best"] = (step, value)


def summary_text(records: Iterable[dict[str, Any]]) -> str:
    """The Markdown summary of a run's records (see ``write_summary``), read in one pass."""
    scan = Scan()
    for record in records:
        scan.add(record)
    return scan.summary.text()


def checkpoint_line(run_dir: Path, last_trained: int | None) -> str:
    """The summary's line on the run's latest checkpoint: what --resume continues from, and, after an
    interrupted run, that the steps logged after it are not kept (a resume trains them again)."""
    latest = latest_checkpoint(run_dir)
    if latest is None:
        return "- Latest checkpoint: none yet (--resume starts the run again)"
    step = checkpoint_step(latest)
    if last_trained is not None and last_trained > step:
        return (
            f"- Latest checkpoint: step {step}, which --resume continues from: steps {step + 1} to "
            f"{last_trained} were logged but not kept, and train again"
        )
    return f"- Latest checkpoint: step {step}"


def write_summary(run_dir: str | Path, scan: Scan | None = None) -> str:
    """Write ``run_dir/summary.md``: number of steps, first/last/best eval accuracy, first/last train
    reward, mean clip fractions, total time (sum of the ``time_*`` metrics) and the latest checkpoint;
    returns the text. ``scan``: the file already read by `scan_run`."""
    run_dir = Path(run_dir)
    summary = (scan or scan_run(run_dir)).summary
    text = summary.text()
    if summary.records:
        text += checkpoint_line(run_dir, summary.train_range[1] if summary.train_range else None) + "\n"
    replace_file(run_path(run_dir, SUMMARY_FILE), text)
    return text
