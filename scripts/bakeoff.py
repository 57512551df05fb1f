"""The GSPO family side by side on the paper study's tiny MoE task: GSPO, GRPO, GMPO, SAPO and CISPO.

What it does, with scripts/experiments/family.py on the paper study's model, cold start, task,
rollout sizes and run layout (scripts/experiments/moe_task.py):
  1. the shared cold start (a ~0.45M-parameter Qwen3-MoE, SFT on sums until it answers some of them);
  2. a learning-rate sweep stated up front: every method at each of `Bakeoff.sweep_lrs`, one seed kept out of
     the comparison (`sweep_seed`), `sweep_steps` rollout batches; each method then takes the rate with the
     highest training reward over the last 20% of its sweep steps (the smaller rate on a tie);
  3. the comparison: every method at its rate, the same seeds (`seeds`), prompt order and rollout budget
     (`steps` rollout batches of 8 prompts x 8 completions, 4 minibatch updates each), paper defaults for
     every objective's knobs, seq-mean-token-mean aggregation for all, no KL, no Routing Replay;
  4. a report (markdown + PNG plots): held-out accuracy and reward over steps, clip or gate fractions, ratio
     statistics, routing volatility, and a verdict table against GSPO with the seeds' noise.

Deliberate departures from the papers: the tiny model and task of docs/paper_reproduction.md, one aggregation
for all (CISPO's paper averages over tokens; with completions of at most 4 tokens the difference is small),
a two-point learning-rate sweep.

Run:
    OMP_NUM_THREADS=1 python scripts/bakeoff.py --workers 2          # full: runs/bakeoff/ and docs/
    OMP_NUM_THREADS=1 python scripts/bakeoff.py --reduced --runs-dir /tmp/b --report-dir /tmp/b
An interrupted run continues where it stopped when started again with the same arguments; with every run
done it only rewrites the report from the run folders.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from experiments import family, runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reduced", action="store_true", help="the test-suite version (well under a minute)")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/bakeoff"), help="run folders (resumable)")
    parser.add_argument("--report-dir", type=Path, default=Path("docs"), help="where the report and PNGs go")
    parser.add_argument("--workers", type=int, default=1, help="runs trained in parallel processes")
    parser.add_argument("--note", default="", help="a sentence for the report, e.g. how busy the machine was")
    args = parser.parse_args(argv)
    command = (
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} python scripts/bakeoff.py "
        + " ".join(sys.argv[1:] if argv is None else argv)
    )
    load = runs.LoadMonitor()
    load.start()
    bake = family.REDUCED if args.reduced else family.FULL
    threads = runs.threads_per_worker(args.workers)
    results = family.study(bake, args.runs_dir, args.report_dir, args.workers, threads)
    note = load.sentence() + (f"{args.note.strip()} " if args.note.strip() else "")
    path = family.write_report(args.report_dir, results, reduced=args.reduced, note=note, command=command)
    print(
        f"report: {path} ({results.cost.total_seconds:.0f} s wall, {results.cost.cpu_seconds:.0f} s CPU in runs)"
    )
    for c in family.verdicts(results.table):
        print(f"  {c.method} vs GSPO, {c.metric}: {c.verdict}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
