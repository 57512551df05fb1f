"""The environment: guess a hidden number from higher/lower hints, in plain Python.

The player has `max_guesses` tries to find a secret number in [low, high]; after each guess it is told
"Higher.", "Lower." or "Correct!". A reply that holds no number costs a guess ("Reply with just a number.").
The games use [1, 10] and 4 guesses: halving the range always wins; guessing at random without repeats
wins 4 games in 10; a player that does not answer with a number never wins.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

NUMBER = re.compile(r"-?\d+")


@dataclass
class Game:
    """One episode's state (mutable: build one per episode, never share it between episodes)."""

    secret: int
    low: int = 1
    high: int = 10
    max_guesses: int = 4
    guesses: list[int | None] = field(default_factory=list)
    won: bool = False

    def rules(self) -> str:
        return (
            f"Guess the number I am thinking of, from {self.low} to {self.high}. Reply with just the number. "
            f"You have {self.max_guesses} tries; I will say higher or lower."
        )

    @property
    def over(self) -> bool:
        return self.won or len(self.guesses) >= self.max_guesses

    def play(self, reply: str) -> str:
        """Take the player's reply; return the host's answer."""
        found = NUMBER.findall(reply)
        guess = int(found[0]) if found else None
        self.guesses.append(guess)
        if guess is None:
            return "Reply with just a number."
        if guess == self.secret:
            self.won = True
            return "Correct!"
        return "Higher. Guess again." if guess < self.secret else "Lower. Guess again."

    def consistent_guesses(self) -> float:
        """The share of guesses that respect every earlier hint (a number inside the range still possible)."""
        low, high, good = self.low, self.high, 0
        for guess in self.guesses:
            if guess is not None and low <= guess <= high:
                good += 1
            if guess is None:
                continue
            if guess < self.secret:
                low = max(low, guess + 1)
            elif guess > self.secret:
                high = min(high, guess - 1)
        return good / max(len(self.guesses), 1)


def secrets(count: int, seed: int) -> list[int]:
    """`count` secrets from 1 to 10 drawn by `seed`: the scenarios (each episode builds its own `Game`)."""
    rng = random.Random(seed)
    return [rng.randint(1, 10) for _ in range(count)]
