"""The tic-tac-toe example's learning curve over seeds: a table of the win rate, the share of illegal
answers and the mean reward per step (each seed and their mean), and a plot.

    python examples/art_tic_tac_toe/curve.py runs/art_tic_tac_toe/seed0 runs/art_tic_tac_toe/seed1 \
        runs/art_tic_tac_toe/seed2 --plot docs/art_tic_tac_toe.png

Each folder is one `train.py --out` (its results.json). The win rate is over the step's own games (4
games x 8 trajectories), played before that step's update: step 1's is the model before training.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

COLUMNS = ("win", "invalid", "reward_mean")


def read(folder: Path) -> tuple[int, list[dict]]:
    results = json.loads((folder / "results.json").read_text())
    return results["seed"], results["train"]


def window_mean(rows: list[dict], key: str, first: int, last: int) -> float:
    values = [row[key] for row in rows[first - 1 : last]]
    return sum(values) / len(values)


def table(runs: list[tuple[int, list[dict]]], windows: list[tuple[int, int]]) -> str:
    """Means over windows of steps (one step's 32 games are a noisy measure), per seed and over seeds."""
    head = "| steps | " + " | ".join(f"seed {seed}: win / illegal / reward" for seed, _ in runs)
    lines = [head + " | mean win | mean illegal |", "|" + "---|" * (len(runs) + 3)]
    for first, last in windows:
        cells = [
            " / ".join(f"{window_mean(rows, key, first, last):.2f}" for key in COLUMNS) for _, rows in runs
        ]
        means = [
            sum(window_mean(rows, key, first, last) for _, rows in runs) / len(runs) for key in COLUMNS[:2]
        ]
        lines.append(f"| {first}-{last} | " + " | ".join(cells) + f" | {means[0]:.2f} | {means[1]:.2f} |")
    return "\n".join(lines)


def draw(runs: list[tuple[int, list[dict]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for seed, rows in runs:
        steps = [row["step"] for row in rows]
        axes[0].plot(steps, [row["win"] for row in rows], label=f"seed {seed}", alpha=0.8)
        axes[1].plot(steps, [row["invalid"] for row in rows], label=f"seed {seed}", alpha=0.8)
    axes[0].set(title="win rate (the step's 32 games)", xlabel="step", ylim=(0, 1))
    axes[1].set(title="illegal answers (share of games)", xlabel="step", ylim=(0, 1))
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", type=Path, nargs="+", help="train.py --out folders, one per seed")
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    runs = [read(folder) for folder in args.runs]
    steps = min(len(rows) for _, rows in runs)
    windows = [(first, min(first + 4, steps)) for first in range(1, steps + 1, 5)]
    print(table(runs, windows))
    if args.plot:
        draw(runs, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
