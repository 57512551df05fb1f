"""The agent: plain code against the official openai SDK; nothing in it knows it is being trained.

It plays one game: the rules as the first user message, then each reply of the model is a guess and each
host answer the next user message. The turn's completion id (which `gspo serve` adds to every answer) goes
into the trajectory; nothing else is needed for training.
"""

from __future__ import annotations

import openai
from game import Game

from gspo.client import Episode


async def play(
    client: openai.AsyncOpenAI, model: str, game: Game, *, temperature: float = 1.0, seed: int | None = None
) -> Episode:
    """Play `game` to its end; the trajectory's reward: 1 for a win, plus 0.2 x the share of guesses that
    respect the hints given so far (a denser signal for a small model). seed: the game's sampling seed
    (evaluation), one per turn derived from it."""
    messages: list = [{"role": "user", "content": game.rules()}]
    trajectory = Episode()
    while not game.over:
        reply = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=6,
            temperature=temperature,
            seed=None if seed is None else 100 * seed + len(game.guesses),  # a stream per turn
        )
        trajectory.add(reply)
        text = reply.choices[0].message.content or ""
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": game.play(text)}]
    trajectory.reward = float(game.won) + 0.2 * game.consistent_guesses()
    trajectory.metrics = {"won": float(game.won), "guesses": float(len(game.guesses))}
    return trajectory
