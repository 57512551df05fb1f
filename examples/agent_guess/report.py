"""The table and plot of docs/agents.md from the seeds' results (train.py writes OUT/results.json).

    python examples/agent_guess/report.py runs/agent_guess/seed0 runs/agent_guess/seed1 runs/agent_guess/seed2

prints a markdown table of held-out success per evaluated step and seed (mean and spread), the training
time, and writes docs/agents_guess.png (held-out success against steps, one line per seed; dotted, the
success of each step's training games).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load(folders: list[Path]) -> list[dict]:
    return [json.loads((folder / "results.json").read_text()) for folder in folders]


def table(runs: list[dict]) -> str:
    steps = sorted({e["step"] for run in runs for e in run["evals"]})
    games = runs[0]["args"]["eval_games"]
    lines = [
        f"| held-out success ({games} games) | " + " | ".join(f"step {s}" for s in steps) + " | minutes |"
    ]
    lines.append("|---" * (len(steps) + 2) + "|")
    for run in runs:
        by_step = {e["step"]: e["success"] for e in run["evals"]}
        cells = [f"{by_step[s]:.3f}" if s in by_step else "" for s in steps]
        lines.append(
            f"| seed {run['seed']} | "
            + " | ".join(cells)
            + f" | {run.get('seconds', run['evals'][-1]['seconds']) / 60:.1f} |"
        )
    means = []
    for s in steps:
        values = [e["success"] for run in runs for e in run["evals"] if e["step"] == s]
        spread = statistics.pstdev(values) if len(values) > 1 else 0.0
        means.append(f"{statistics.mean(values):.3f} ± {spread:.3f}")
    lines.append("| mean ± std over seeds | " + " | ".join(means) + " | |")
    return "\n".join(lines)


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.6))
    for run in runs:
        steps = [e["step"] for e in run["evals"]]
        line = axis.plot(steps, [e["success"] for e in run["evals"]], marker="o", label=f"seed {run['seed']}")
        # the training games' success (fresh games each step, 18 to 32 episodes): noisier, but every step
        train = run["train"]
        axis.plot(
            [t["step"] for t in train],
            [t["won"] for t in train],
            linestyle=":",
            color=line[0].get_color(),
            alpha=0.7,
        )
    axis.set_xlabel("train calls (steps)")
    axis.set_ylabel("success (dotted: training games)")
    axis.set_ylim(0, 1)
    axis.set_title("SmolLM2-135M guessing a number through gspo serve (CPU)")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "agents_guess.png")
    args = parser.parse_args()
    runs = load(args.folders)
    print(table(runs))
    plot(runs, args.plot)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
