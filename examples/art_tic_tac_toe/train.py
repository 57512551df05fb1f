"""ART's tic-tac-toe example (OpenPipe/ART, examples/tic_tac_toe), trained with gspo's ART backend.

    python examples/art_tic_tac_toe/train.py --steps 20 --out runs/art_tic_tac_toe/seed0
    python examples/art_tic_tac_toe/train.py --smoke    # the tiny random model, 1 step of 2 games

The client code is ART's: an `art.TrainableModel` registered with a backend, rollouts that play through
`model.openai_client()` and append each choice to an `art.Trajectory`, `art.gather_trajectory_groups`, then
`backend.train(model, groups)`. As in ART's example, the agent plays x or o (at random) against an opponent
that plays random legal moves, answers each board with `<move>B2</move>`, and gets 1 for a win, 0.5 for a
draw, 0 for a loss, and -1 + log(moves + 1) / log(100) for an answer that is not a legal move (the game
ends there). The backend is `GspoBackend`, which starts `gspo serve` with serve.yaml (SmolLM2-135M-Instruct,
GSPO) as a child process. Needs openpipe-art: pip install 'gspo[art]'. Writes OUT/results.json (every
step's win rate, reward and train metrics).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SMOKE = {"steps": 1, "games": 2, "group_size": 2, "max_tokens": 8}
"""--smoke: the run's size (the server gets the tiny random model)."""

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # art imports litellm, which would fetch prices
import art  # noqa: E402

from gspo.integrations.art import GspoBackend  # noqa: E402

EMPTY = "_"
MOVE_FORMATS = {
    "tag": re.compile(r"<move>\s*([ABC])([123])\s*</move>"),
    "coordinate": re.compile(r"\b([ABC])([123])\b"),
}
"""How an answer's move is read: "tag", ART's example (`<move>B2</move>`); "coordinate", also the first bare
coordinate (B2), for a model too small to write the tags (SmolLM2-135M: docs/agents.md)."""


def winner(board: list[list[str]]) -> str | None:
    """'x', 'o', 'draw', or None while the game goes on."""
    lines = [*board, *([board[r][c] for r in range(3)] for c in range(3))]
    lines += [[board[i][i] for i in range(3)], [board[i][2 - i] for i in range(3)]]
    for line in lines:
        if line[0] != EMPTY and line.count(line[0]) == 3:
            return line[0]
    return "draw" if all(cell != EMPTY for row in board for cell in row) else None


def render(board: list[list[str]]) -> str:
    rows = [f"{'ABC'[r]}  {' | '.join(board[r])}" for r in range(3)]
    return "\n".join(["   1   2   3", *rows])


def opponent_move(board: list[list[str]], symbol: str, rng: random.Random) -> None:
    free = [(r, c) for r in range(3) for c in range(3) if board[r][c] == EMPTY]
    r, c = rng.choice(free)
    board[r][c] = symbol


async def rollout(model: art.TrainableModel, seed: int, max_tokens: int, move: re.Pattern) -> art.Trajectory:
    """One game, as ART's example plays it."""
    rng = random.Random(seed)
    board = [[EMPTY] * 3 for _ in range(3)]
    me, them = rng.choice([("x", "o"), ("o", "x")])
    system = (
        "You are a tic-tac-toe player. You are playing against an opponent. Always choose the move most "
        "likely to lead to an eventual win. Return your move as an XML object with a single property "
        f"'move', like so: <move>A1</move>. Optional moves are 'A1', 'B3', 'C2', etc. You are the {me} symbol."
    )
    trajectory = art.Trajectory(messages_and_choices=[{"role": "system", "content": system}], reward=0.0)
    if me == "o":
        opponent_move(board, them, rng)
    client = model.openai_client()
    moves = 0
    while winner(board) is None:
        trajectory.messages_and_choices.append({"role": "user", "content": render(board)})
        chat = await client.chat.completions.create(
            model=model.get_inference_name(), messages=trajectory.messages(), max_tokens=max_tokens
        )
        choice = chat.choices[0]
        trajectory.messages_and_choices.append(choice)
        found = move.search(choice.message.content or "")
        row, col = ("ABC".index(found[1]), int(found[2]) - 1) if found else (0, 0)
        if not found or board[row][col] != EMPTY:
            trajectory.reward = -1 + math.log(moves + 1) / math.log(100)
            trajectory.metrics["invalid"] = 1.0
            break
        board[row][col] = me
        moves += 1
        if winner(board) is None:
            opponent_move(board, them, rng)
    result = winner(board)
    if result is not None:
        trajectory.reward = {me: 1.0, them: 0.0, "draw": 0.5}[result]
        trajectory.metrics["win"] = float(result == me)
    trajectory.metrics["moves"] = moves
    return trajectory


async def run(args: argparse.Namespace) -> dict:
    overrides = [f"seed={args.seed}", f"output_dir={args.out / 'run'}"]
    if args.smoke:
        overrides.append("model.tiny=llama")
    backend = GspoBackend(config=HERE / "serve.yaml", overrides=overrides)
    model = art.TrainableModel(
        name=f"tic-tac-toe-{args.seed}",
        project="gspo-art",
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
        base_path=str(args.out / ".art"),
    )
    results: dict = {"seed": args.seed, "args": {k: str(v) for k, v in vars(args).items()}, "train": []}
    try:
        await model.register(backend)
        for step in range(await model.get_step(), args.steps):
            start = time.perf_counter()
            seeds = [1_000_000 * args.seed + 1_000 * step + g for g in range(args.games)]
            groups = await art.gather_trajectory_groups(
                (
                    art.TrajectoryGroup(
                        rollout(model, seed * 100 + i, args.max_tokens, MOVE_FORMATS[args.move_format])
                        for i in range(args.group_size)
                    )
                    for seed in seeds
                ),
                pbar_desc=None,
            )
            played = time.perf_counter()
            result = await backend.train(model, groups)
            trajectories = [t for g in groups for t in g.trajectories]
            row = {
                "step": result.step,
                "win": sum(t.metrics.get("win", 0.0) for t in trajectories) / len(trajectories),
                "invalid": sum(t.metrics.get("invalid", 0.0) for t in trajectories) / len(trajectories),
                "reward_mean": result.metrics["reward_mean"],
                "time_rollout": played - start,
                "time_train_call": time.perf_counter() - played,
            }
            results["train"].append(row)
            print(
                f"step {row['step']}: win {row['win']:.3f} invalid {row['invalid']:.3f} "
                f"reward {row['reward_mean']:.3f}",
                flush=True,
            )
            (args.out / "results.json").write_text(json.dumps(results, indent=1))
    finally:
        await backend.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--games", type=int, default=4, help="games (scenarios) per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--move-format", choices=list(MOVE_FORMATS), default="tag", help="tag: ART's; coordinate: also B2"
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="the tiny random model, 1 step of 2 games")
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    args.out = args.out or Path("runs") / "art_tic_tac_toe" / f"seed{args.seed}"
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = asyncio.run(run(args))
    print(f"results: {args.out / 'results.json'} ({len(results['train'])} steps)")


if __name__ == "__main__":
    main()
