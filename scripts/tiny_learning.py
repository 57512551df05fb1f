"""Does the tiny config learn? Held-out accuracy of `gspo train configs/tiny.yaml` at several seeds.

configs/tiny.yaml is the smoke run: a randomly initialised 2-layer Llama with a character tokenizer, on
the default arithmetic prompts ("What is 3 + 5? Answer with just the number."). Such a model cannot learn
addition in seconds; what it can learn is the answer's format, which the prompt asks for, and the first
reward (`number_format`, the eval accuracy) scores: a bare number. This script trains the config as it is
at each seed (only output_dir, seed and tensorboard overridden) and prints each evaluation's accuracy, the
share of sampled training completions that are bare numbers at the first and last step, and the run's
wall time.

Run:  HF_HUB_OFFLINE=1 python scripts/tiny_learning.py [--seeds 3] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from gspo import load_config, train
from gspo.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]


def run_seed(seed: int, overrides: list[str], folder: Path) -> dict:
    """One run of configs/tiny.yaml at `seed`: its eval accuracies by step and its wall time."""
    run_dir = folder / f"seed{seed}"
    config = load_config(
        ROOT / "configs" / "tiny.yaml",
        [*overrides, f"seed={seed}", f"output_dir={run_dir}", "report_to=[]"],
    )
    start = time.perf_counter()
    train(config)
    seconds = time.perf_counter() - start
    rows = read_metrics(run_dir)
    evals = [row for row in rows if row["kind"] == "eval"]
    sampled = [row["reward/number_format"] for row in rows if row["kind"] == "train"]
    return {
        "seed": seed,
        "accuracy": {row["step"]: row["accuracy"] for row in evals},
        "train_number_format": {"first": sampled[0], "last": sampled[-1]},
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="key=value overrides of configs/tiny.yaml")
    args = parser.parse_args()
    print(
        f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(f"# configs/tiny.yaml {' '.join(args.overrides)}")
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for seed in range(args.seeds):
            result = run_seed(seed, args.overrides, Path(folder))
            results.append(result)
            curve = "  ".join(f"{step}: {acc:.2f}" for step, acc in result["accuracy"].items())
            sampled = result["train_number_format"]
            print(
                f"seed {seed}  held-out accuracy by step  {curve}  train reward/number_format "
                f"{sampled['first']:.2f} -> {sampled['last']:.2f}  ({result['seconds']:.1f} s)",
                flush=True,
            )
    curves = [list(r["accuracy"].values()) for r in results]
    risen = sum(curve[-1] > curve[0] for curve in curves)
    print(f"accuracy rose in {risen} of {len(results)} seeds")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
