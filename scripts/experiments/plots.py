"""The studies' figures: one panel per metric, one line per method over rollouts, a band over seeds."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from experiments.summary import Records, mean, series


@dataclass(frozen=True)
class Panel:
    key: str
    kind: str
    """"train" or "eval" records."""
    label: str
    log: bool = False
    """A symlog y axis (linear below 1e-3)."""


@dataclass(frozen=True)
class Figure:
    name: str
    """The PNG's file name."""
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class Row:
    """One row of a figure's panels: a line per method, each over that method's runs (one per seed)."""

    title: str | None
    runs: dict[str, list[Records]]
    labels: dict[str, str]


@dataclass(frozen=True)
class Look:
    """How a study draws: its methods' colours, x scale and smoothing, band and sizes."""

    colors: dict[str, str]
    rollouts_per_step: int
    window: int
    """Moving average over this many steps of the train metrics (eval points are not smoothed)."""
    band_alpha: float = 0.15
    row_height: float = 3.6
    legend_size: int = 8


def smooth(ys: list[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` points (unchanged when shorter than the window)."""
    if window <= 1 or len(ys) < window:
        return ys
    return [mean(ys[max(0, i - window + 1) : i + 1]) for i in range(len(ys))]


def band(
    per_seed: list[Records], key: str, kind: str, rollouts_per_step: int, window: int
) -> tuple[list[int], list[float], list[float], list[float]]:
    """x (rollouts), mean over seeds, min and max over seeds, each seed smoothed first; the steps all have."""
    curves = [series(r, key, kind) for r in per_seed]
    steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    if not steps:
        return [], [], [], []
    columns = list(zip(*(smooth([c[s] for s in steps], window) for c in curves), strict=True))
    return (
        [s * rollouts_per_step for s in steps],
        [mean(list(c)) for c in columns],
        [min(c) for c in columns],
        [max(c) for c in columns],
    )


def _draw_panel(ax, panel: Panel, row: Row, look: Look) -> bool:
    """One panel's lines and bands; False when no method has a point to draw."""
    drawn = False
    for method, per_seed in row.runs.items():
        x, y, lo, hi = band(
            per_seed,
            panel.key,
            panel.kind,
            look.rollouts_per_step,
            1 if panel.kind == "eval" else look.window,
        )
        if not x:
            continue
        drawn = True
        marker = "o" if panel.kind == "eval" else None
        ax.plot(x, y, color=look.colors[method], label=row.labels[method], marker=marker, ms=3)
        if len(per_seed) > 1:
            ax.fill_between(x, lo, hi, color=look.colors[method], alpha=look.band_alpha, linewidth=0)
    if panel.log:
        ax.set_yscale("symlog", linthresh=1e-3)
    if row.title is not None:
        ax.set_title(row.title, fontsize=9)
    ax.set_xlabel("rollouts (completions sampled)")
    ax.set_ylabel(panel.label, fontsize=8)
    ax.grid(alpha=0.3)
    return drawn


def plot(path: Path, figure: Figure, rows: list[Row], look: Look) -> Path | None:
    """``figure``'s panels in columns, one row of them per ``rows`` entry, saved to ``path``; None (and no
    file) when nothing could be drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(figure.panels)
    fig, axes = plt.subplots(len(rows), n, figsize=(5.2 * n, look.row_height * len(rows)), squeeze=False)
    drawn = False
    for row_axes, row in zip(axes, rows, strict=True):
        for ax, panel in zip(row_axes, figure.panels, strict=True):
            drawn = _draw_panel(ax, panel, row, look) or drawn
    axes[0][0].legend(fontsize=look.legend_size)
    fig.suptitle(figure.title)
    fig.tight_layout()
    if not drawn:
        plt.close(fig)
        return None
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_all(report_dir: Path, figures: list[Figure], rows: list[Row], look: Look) -> list[Path]:
    """Every figure that has something to draw, as PNGs in ``report_dir``."""
    paths = [plot(report_dir / f.name, f, rows, look) for f in figures]
    return [p for p in paths if p is not None]
