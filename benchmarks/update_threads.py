"""Why an update runs slower while a second thread samples: the update phase of one rollout batch, timed
with the trainer's thread alone, and after another thread has run torch ops (as the sampling side's thread
does at rollout.lag >= 1), with that thread's OpenMP settings as given.

One process, the default config (SmolLM2-135M), one rollout batch drawn at lag 0 and trained on again and
again (every sample computed: train.skip_zero_advantage=false; the same work each time). Variants, run in
turn, `--rounds` times each:

- `alone`: only the trainer's thread has run torch ops;
- `team`: a second thread ran one parallel op (a sum over 8 MB), creating an OpenMP team of its own, and
  now sleeps; libgomp then manages more threads than there are CPUs and throttles every team's spin
  before sleeping (GOMP_SPINCOUNT's throttled count: about 100 spins instead of 300,000);
- `single`: the same second thread, with one OpenMP and one MKL thread of its own before its op
  (gspo.run.cpu.one_cpu_thread: what the sampling side's thread does), so that it makes no team.

Prints, per variant, the median update seconds and the trainer thread's context switches (voluntary,
involuntary) and minor page faults per update (getrusage RUSAGE_THREAD), with the CPU. The variants run in
separate processes: a team, once made, lives as long as its thread.

    HF_HUB_OFFLINE=1 python benchmarks/update_threads.py [--rounds 3] [--updates 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from grad_norm import cpu_name

CHILD = r"""
import json, resource, statistics, sys, tempfile, threading, time
from gspo.run.allocator import keep_freed_memory
keep_freed_memory()
import torch
from gspo.config import load_config
from gspo.core.seeds import step_seed
from gspo.learning.step import learn_from_samples
from gspo.run.cpu import one_cpu_thread
from gspo.training.trainer import Trainer

variant, updates = sys.argv[1], int(sys.argv[2])
done = threading.Event()


def second_thread(single: bool) -> None:
    if single:
        one_cpu_thread()
    torch.ones(2_000_000).sum()  # an op big enough for ATen to run it in parallel
    done.set()
    time.sleep(3600)


with tempfile.TemporaryDirectory() as run:
    config = load_config(None, [f"output_dir={run}/run", "checkpoint.every=0", "eval.every=1000",
                                "report_to=[]", "train.skip_zero_advantage=false", "rollout.dynamic_sampling=false"])
    trainer = Trainer(config)
    samples, _ = trainer.sample()
    learn_from_samples(trainer.policy, trainer.spec, samples, seed=1)  # warm
    if variant != "alone":
        threading.Thread(target=second_thread, args=(variant == "single",), daemon=True).start()
        done.wait()
    rows = []
    for i in range(updates):
        before = resource.getrusage(resource.RUSAGE_THREAD)
        metrics = learn_from_samples(trainer.policy, trainer.spec, samples, seed=2 + i)
        after = resource.getrusage(resource.RUSAGE_THREAD)
        rows.append((metrics["time_update"], after.ru_nvcsw - before.ru_nvcsw,
                     after.ru_nivcsw - before.ru_nivcsw, after.ru_minflt - before.ru_minflt))
print(json.dumps([statistics.median(column) for column in zip(*rows)]))
"""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--updates", type=int, default=3)
    args = parser.parse_args()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    results: dict[str, list[list[float]]] = {"alone": [], "team": [], "single": []}
    for _ in range(args.rounds):
        for variant in results:
            out = subprocess.run(
                [sys.executable, "-c", CHILD, variant, str(args.updates)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
                cwd=Path(__file__).resolve().parent,
            )
            results[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(
        f"{cpu_name()}, {os.cpu_count()} CPUs; {args.rounds} processes per variant, {args.updates} updates each"
    )
    print(
        "| variant | update s (median of processes) | voluntary switches | involuntary switches | minor faults |"
    )
    print("|---|---|---|---|---|")
    for variant, rows in results.items():
        seconds, voluntary, involuntary, faults = (
            statistics.median(column) for column in zip(*rows, strict=True)
        )
        print(f"| {variant} | {seconds:.2f} | {voluntary:.0f} | {involuntary:.0f} | {faults:.0f} |")
    base = statistics.median(r[0] for r in results["alone"])
    for variant in ("team", "single"):
        print(f"{variant}: {statistics.median(r[0] for r in results[variant]) / base:.2f}x the update alone")


if __name__ == "__main__":
    main()
