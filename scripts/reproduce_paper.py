"""Reproduce the GSPO paper's MoE claims at small scale: GRPO vs GRPO + Routing Replay vs GSPO.

What it does (seed 002's section 3-4; arXiv 2507.18071, sections 5.1-5.3), with scripts/experiments/paper.py:
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
arguments (finished runs are skipped, unfinished ones resume from their last checkpoint); with every run
done it only rewrites the report from the run folders.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from experiments import paper, runs


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
    spec = paper.sized(
        args.reduced,
        seeds=tuple(args.seeds) if args.seeds else None,
        lrs=tuple(args.lrs) if args.lrs else None,
        steps=args.steps,
        minibatch_split=args.split,
    )
    results = paper.study(
        spec, args.runs_dir, args.report_dir, args.workers, runs.threads_per_worker(args.workers)
    )
    path = paper.write_report(args.report_dir, results, reduced=args.reduced)
    cost = results.cost
    print(
        f"report: {path} ({cost.total_seconds:.0f} s; per RL step, run overheads included: "
        f"{cost.wall_per_step:.2f} s wall, {cost.cpu_per_step:.2f} s CPU per worker)"
    )
    for lr, table in results.tables.items():
        for v in paper.verdicts(table):
            print(f"  lr {lr:g}: {v.verdict}: {v.claim}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
