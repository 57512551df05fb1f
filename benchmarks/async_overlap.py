"""Sampling ahead of the updates, and rewards as a stage of their own, timed (docs/async.md, docs/rewards.md).

`--case wait` (the default): the default run (SmolLM2, the arithmetic task; dynamic sampling off, so every batch
samples the same number of groups) with a reward that waits `--wait`
seconds per rollout batch, as a code sandbox or a remote scorer would, at rollout.lag = 0 and 1. Runs
alternate (lag 0, lag 1, lag 0, ...), each `--steps` rollout batches through `Trainer.train_step`; the first
batch of each run is left out (its sampling has nothing to overlap). Prints each run's median wall seconds per
rollout batch, the ratio, and the ideal (compute + wait) / max(compute, wait), with the CPU: at lag 1 a batch
is scored while the next one samples and the trainer learns on the one before.

`--case judge`: an LLM judge's latency, an async reward that waits `--call` seconds per completion, scoring a
rollout batch's 64 completions (rollout.prompts_per_step x group_size) at the default reward_concurrency: the
median seconds per batch over `--rounds` batches, against the ideal of calls x wait / concurrency and the
serial calls x wait.

    HF_HUB_OFFLINE=1 python benchmarks/async_overlap.py [--wait 5] [--steps 6] [--rounds 2]
    python benchmarks/async_overlap.py --case judge [--call 0.1] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
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
            # the same groups' worth of work in every batch: dynamic sampling's redraws depend on the scores
            "rollout.dynamic_sampling=false",
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


def judge_case(call: float, rounds: int) -> None:
    """An async per-completion reward that waits ``call`` seconds, scoring 64 completions (module docstring)."""
    from gspo.config import Config
    from gspo.rewards.calling import prepare
    from gspo.rewards.scoring import compute_rewards

    async def judge(completion: str, **_: object) -> float:
        await asyncio.sleep(call)
        return float(len(completion) % 2)

    config = Config()
    batch = config.rollout.prompts_per_step * config.rollout.group_size
    prepared = prepare(judge, "judge", timeout=config.reward_timeout, concurrency=config.reward_concurrency)
    completions = [f"completion {i}" for i in range(batch)]
    seconds = []
    for _ in range(rounds):
        start = time.perf_counter()
        compute_rewards([("judge", prepared, 1.0)], ["p"] * batch, completions, {})
        seconds.append(time.perf_counter() - start)
    ideal = call * -(-batch // config.reward_concurrency)
    print(f"{cpu_name()}; an async reward that waits {call:g} s per completion")
    print(
        f"{batch} completions at reward_concurrency={config.reward_concurrency}: {statistics.median(seconds):.3f} s "
        f"per rollout batch (ideal {ideal:.3f} s; one call at a time: {call * batch:.1f} s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--case", choices=["wait", "judge"], default="wait")
    parser.add_argument("--wait", type=float, default=5.0, help="seconds the reward waits per rollout batch")
    parser.add_argument("--call", type=float, default=0.1, help="judge: seconds per completion")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.case == "judge":
        judge_case(args.call, args.rounds)
        return
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
