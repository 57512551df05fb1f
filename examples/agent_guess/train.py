"""Train the guessing-game agent through `gspo serve` (docs/agents.md).

    python examples/agent_guess/train.py --seed 0 --out runs/agent_guess/seed0
    python examples/agent_guess/train.py --smoke    # the tiny random model, 1 step of 2 games: seconds

starts `gspo serve examples/agent_guess/serve.yaml` (seed, run folder under --out), measures the held-out
success rate, then each step plays `--games` fresh games `--group-size` times each with the agent
(agent.py, the official openai SDK), trains on the groups, and measures again every `--eval-every` steps.
Writes OUT/results.json (every step's train metrics and evaluations); report.py draws the table and plot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from agent import play  # noqa: E402
from game import Game, secrets  # noqa: E402

from gspo.client import Client  # noqa: E402

EVAL_SEED = 10_000
"""The held-out games' seed; training games use seeds 1_000 * run seed + step."""
SMOKE = {"steps": 1, "games": 2, "group_size": 2, "eval_games": 2, "eval_every": 1}
"""--smoke: the run's size (the server gets the tiny random model)."""


def start_server(seed: int, run_dir: Path, log: Path, overrides: list[str]) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "gspo", "serve", str(HERE / "serve.yaml"), f"seed={seed}"]
    command += [f"output_dir={run_dir}", "serve.port=0", *overrides]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    line = process.stdout.readline()
    if not line.startswith("gspo serve: http://"):
        process.kill()
        raise SystemExit(f"gspo serve did not start: see {log}")
    return process, line.split()[2]


async def evaluate(client: Client, count: int) -> dict[str, float]:
    """Success on `count` held-out games, sampled at temperature 1 with a fixed seed per game."""
    held_out = [Game(secret) for secret in secrets(count, EVAL_SEED)]
    agent = client.async_openai
    trajectories = await asyncio.gather(
        *(play(agent, client.model, g, seed=i) for i, g in enumerate(held_out))
    )
    return {
        "success": sum(t.metrics["won"] for t in trajectories) / count,
        "reward": sum(t.reward for t in trajectories) / count,
        "numbers": sum(g.guesses.count(None) == 0 for g in held_out) / count,
    }


async def run(args: argparse.Namespace, client: Client) -> dict:
    results: dict = {"seed": args.seed, "args": {k: str(v) for k, v in vars(args).items()}}
    results |= {"evals": [], "train": []}
    start = time.perf_counter()

    async def measure(step: int) -> None:
        result = await evaluate(client, args.eval_games)
        results["evals"].append({"step": step, **result, "seconds": time.perf_counter() - start})
        print(
            f"step {step}: held-out success {result['success']:.3f} (reward {result['reward']:.3f})",
            flush=True,
        )
        # written after every evaluation: a run stopped early keeps what it measured
        (args.out / "results.json").write_text(json.dumps(results, indent=1))

    await measure(0)
    for step in range(1, args.steps + 1):
        scenarios = secrets(args.games, 1_000 * args.seed + step)  # each episode builds its own Game
        t0 = time.perf_counter()
        groups = await client.gather(
            lambda agent, secret: play(agent, client.model, Game(secret)), scenarios, args.group_size
        )
        t1 = time.perf_counter()
        answer = await client.atrain(groups)
        won = [t.metrics["won"] for g in groups for t in g.trajectories]
        metrics = answer["metrics"]
        row = {
            "step": step,
            "won": sum(won) / len(won),
            "time_rollout": t1 - t0,
            "time_train_call": time.perf_counter() - t1,
        }
        row |= {  # a step whose groups all scored alike has no update, so no loss or clip metrics
            k: metrics[k]
            for k in ("reward_mean", "loss", "clip_frac_seq", "time_update", "split_trajectories")
            if k in metrics
        }
        results["train"].append(row)
        print(
            f"step {step}: won {row['won']:.3f} reward {row['reward_mean']:.3f} ({t1 - t0:.0f}s + {row['time_train_call']:.0f}s)",
            flush=True,
        )
        if step % args.eval_every == 0 or step == args.steps:
            await measure(step)
    results["seconds"] = time.perf_counter() - start
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--games", type=int, default=3, help="games (scenarios) per step")
    parser.add_argument("--group-size", type=int, default=6)
    parser.add_argument("--eval-games", type=int, default=32)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--smoke", action="store_true", help="the tiny random model, 1 step of 2 games, in seconds"
    )
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    out = args.out = args.out or Path("runs") / "agent_guess" / f"seed{args.seed}"
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # SIGTERM too runs the `finally` below: the server is our child and must not outlive us
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    overrides = ["model.tiny=llama"] if args.smoke else []
    process, url = start_server(args.seed, out / "run", out / "server.log", overrides)
    try:
        results = asyncio.run(run(args, Client(url)))
    finally:
        process.terminate()
        process.wait(60)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"results: {out / 'results.json'}")


if __name__ == "__main__":
    main()
