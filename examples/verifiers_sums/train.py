"""Train a verifiers v1 environment through `gspo serve`: the taskset of this folder (sums_taskset.py, one-digit
sums scored by its own `@reward`s), one agent per task that answers in one turn, SmolLM2-135M-Instruct.

    python examples/verifiers_sums/train.py                # 10 steps of 4 sums x 8 episodes (minutes on a CPU)
    python examples/verifiers_sums/train.py --smoke        # the tiny random model, 1 step (CI runs this)

It starts `gspo serve` (serve.yaml) in this process, measures the held-out sums' accuracy (greedy, the
`correct` reward), trains `--steps` steps with gspo.integrations.verifiers.train_step (each task's episodes
run against the live policy, scored by the taskset, trained on the sampled tokens), and measures again.
Needs verifiers: pip install 'gspo[verifiers]'. Writes OUT/results.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the taskset's id is its module's name, sums_taskset
# no model download, and no loading bar (as the CLI): read when the libraries are imported, below
for name in ("HF_HUB_OFFLINE", "HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE"):
    os.environ.setdefault(name, "1")

import verifiers.v1 as vf  # noqa: E402

from gspo.client import Client  # noqa: E402
from gspo.config import load_config  # noqa: E402
from gspo.integrations.verifiers import harness_config, model_context, rollouts, train_step  # noqa: E402
from gspo.serve.server import build_service, start_in_thread  # noqa: E402

SMOKE = {"steps": 1, "tasks": 2, "group_size": 2, "held_out": 4}
"""--smoke: the run's size (the server gets the tiny random model)."""


def environment() -> vf.SingleAgentEnv:
    agent = vf.AgentConfig(harness=harness_config(), runtime=vf.SubprocessConfig())
    return vf.SingleAgentEnv(
        vf.SingleAgentEnvConfig(taskset=vf.TasksetConfig(id="sums_taskset"), agent=agent)
    )


async def accuracy(env: vf.SingleAgentEnv, client: Client, tasks: list[vf.Task], max_tokens: int) -> float:
    """The share of `tasks` whose greedy answer the taskset's `correct` reward scores 1."""
    context = model_context(client, vf.Sampling(temperature=0.0, max_tokens=max_tokens))
    groups = await rollouts(env, tasks, context, group_size=1)
    return sum(group[0].traces[0].rewards["correct"].score for group in groups) / len(groups)


async def run(args: argparse.Namespace, url: str) -> dict:
    env, client = environment(), Client(url)
    tasks = list(env.taskset)
    held_out, train = tasks[: args.held_out], tasks[args.held_out :]
    sampling = vf.Sampling(temperature=1.0, max_tokens=args.max_tokens)
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "train": []}
    async with env.serving():
        results["accuracy_before"] = await accuracy(env, client, held_out, args.max_tokens)
        print(f"held-out accuracy before: {results['accuracy_before']:.3f}", flush=True)
        for step in range(args.steps):
            start = time.perf_counter()
            batch = [train[(args.tasks * step + i) % len(train)] for i in range(args.tasks)]
            answer = await train_step(env, client, batch, group_size=args.group_size, sampling=sampling)
            metrics = answer["metrics"]
            row = {"step": answer["version"], "reward_mean": metrics["reward_mean"], "seconds": 0.0}
            row["seconds"] = time.perf_counter() - start
            results["train"].append(row)
            print(f"step {row['step']}: reward {row['reward_mean']:.3f} ({row['seconds']:.0f} s)", flush=True)
        results["accuracy_after"] = await accuracy(env, client, held_out, args.max_tokens)
    print(f"held-out accuracy: {results['accuracy_before']:.3f} -> {results['accuracy_after']:.3f}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tasks", type=int, default=4, help="tasks (groups) per step")
    parser.add_argument("--group-size", type=int, default=8, help="episodes per task")
    parser.add_argument("--held-out", type=int, default=20, help="tasks kept out of training, for accuracy")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="the tiny random model, 1 step of 2 tasks")
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    args.out = args.out or Path("runs") / f"verifiers_sums-{time.strftime('%Y%m%d-%H%M%S')}"
    args.out.mkdir(parents=True, exist_ok=True)
    overrides = [f"seed={args.seed}", f"output_dir={args.out / 'run'}"]
    overrides += ["model.tiny=llama"] if args.smoke else []
    server = start_in_thread(build_service(load_config(HERE / "serve.yaml", overrides)))
    try:
        results = asyncio.run(run(args, server.url))
    finally:
        server.stop()  # the last checkpoint (serve.durable=false), the run folder's lock released
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"results: {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
