"""Whole groups per minibatch or any samples? `train.minibatch_split` measured on two tasks, several seeds.

With "group" the 4 minibatches of a rollout batch hold whole groups (a prompt's G samples together, so the
shared-prefix layout computes each prompt once per update); with "sample" each minibatch holds a random
quarter of all samples (the layout then shares a prompt among the ~G/4 samples of it that landed there).
Both give unbiased updates; they differ in which samples each optimizer step sees together. This script
(scripts/experiments/split.py) trains both on:
  * the default run (SmolLM2-135M-Instruct, single-digit sums, 40 rollout batches), seeds 0..N-1;
  * the paper-reproduction task (scripts/experiments/paper.py: a tiny Qwen3-MoE, GRPO, GRPO + Routing
    Replay and GSPO, lr 1e-3, 300 rollout batches), seeds 0..2;
and writes docs/minibatch_split.md: held-out accuracy, training reward and clip fractions, mean and
spread over seeds, and which split the evidence favours.

Run:  HF_HUB_OFFLINE=1 python scripts/minibatch_split.py [--seeds 3] [--workers 2] [--skip-paper]
Runs are kept in runs/minibatch_split/ and a finished run is not trained again: with every run done the
script only rewrites the report from the run folders.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from experiments import split

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the default run per split")
    parser.add_argument("--workers", type=int, default=2, help="runs trained at once (one thread each)")
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "minibatch_split")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "minibatch_split.md")
    parser.add_argument("--skip-paper", action="store_true", help="only the default run")
    args = parser.parse_args(argv)
    results = split.study(args.runs_dir, args.seeds, args.workers, args.skip_paper)
    doc = split.write_report(args.doc, results, args.workers)
    print(f"wrote {doc} ({results.minutes:.0f} min; {results.trained} default runs trained now)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
