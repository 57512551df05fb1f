"""Sampling ahead of the updates, timed: the default run (SmolLM2, the arithmetic task) with a reward that
waits `--wait` seconds per rollout batch, as an LLM judge or a code sandbox would, at rollout.lag = 0 and 1.
Runs alternate (lag 0, lag 1, lag 0, ...), each `--steps` rollout batches through `Trainer.train_step`; the
first batch of each run is left out (its sampling has nothing to overlap). Prints each run's median wall
seconds per rollout batch, the ratio, and the ideal (compute + wait) / max(compute, wait), with the CPU.

    HF_HUB_OFFLINE=1 python benchmarks/async_overlap.py [--wait 5] [--steps 6] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from grad_norm import cpu_name

from gspo.config import load_config
from gspo.training.trainer import Trainer

JUDGE = '''
import time


def judge(prompts, completions, **_):
    """A slow reward: waits WAIT seconds per rollout batch, then scores nothing (weight 0)."""
    time.sleep(WAIT)
    return [0.0] * len(completions)
'''


def run(lag: int, wait_file: Path, steps: int, folder: Path) -> list[float]:
    """Wall seconds of each rollout batch (sampling as the loop waits for it, and the updates)."""
    rewards = f"{{correct_number: 1.0, number_format: 0.5, {wait_file}:judge: 0.0}}"
    config = load_config(
        None,
        [
            f"output_dir={folder}",
            f"rollout.lag={lag}",
            f"train.steps={steps}",
            f"rewards={rewards}",
            "eval.every=0",
            "task.num_eval=0",
            "checkpoint.every=0",
            "report_to=[]",
            "progress=false",
        ],
    )
    trainer = Trainer(config)
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.train_step()
        seconds.append(time.perf_counter() - start)
    trainer.rollouts.close()
    trainer.home.release()
    return seconds[1:]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--wait", type=float, default=5.0, help="seconds the reward waits per rollout batch")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wait_file = Path(tmp) / "judge.py"
        wait_file.write_text(JUDGE.replace("WAIT", repr(args.wait)))
        medians: dict[int, list[float]] = {0: [], 1: []}
        for r in range(args.rounds):
            for lag in (0, 1):
                per_batch = run(lag, wait_file, args.steps, Path(tmp) / f"run-{r}-{lag}")
                medians[lag].append(statistics.median(per_batch))
                print(f"round {r + 1}, lag {lag}: {medians[lag][-1]:.2f} s per rollout batch", flush=True)
    sync, ahead = min(medians[0]), min(medians[1])
    compute = sync - args.wait
    ideal = sync / max(compute, args.wait)
    print(f"{cpu_name()}; reward waits {args.wait:.1f} s per rollout batch")
    print(
        f"best: lag 0 {sync:.2f} s, lag 1 {ahead:.2f} s per rollout batch: {sync / ahead:.2f}x (ideal {ideal:.2f}x)"
    )


if __name__ == "__main__":
    main()
