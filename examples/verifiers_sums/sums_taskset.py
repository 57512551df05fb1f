"""A verifiers v1 taskset of one-digit sums, "What is 3 + 5? Answer with just the number.", scored by its
own rewards: `correct` (the reply's last number is the sum, weight 1) and `bare_number` (the reply is just a
number, as asked, weight 0.25). Its id is this module's name: train.py puts this folder on the import path.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

import verifiers.v1 as vf

__all__ = ["SumsTaskset"]  # a verifiers taskset plugin exports its Taskset class

NUMBER = re.compile(r"-?\d+")


class SumsData(vf.TaskData):
    answer: int


class SumsTask(vf.Task[SumsData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        """1 when the last number of the last reply is the sum: the held-out accuracy."""
        numbers = NUMBER.findall(reply(trace))
        return float(bool(numbers) and int(numbers[-1]) == self.data.answer)

    @vf.reward(weight=0.25)
    async def bare_number(self, trace: vf.Trace) -> float:
        """1 when the reply is a number and nothing else: a signal a small model gets early."""
        return float(NUMBER.fullmatch(reply(trace).strip()) is not None)


def reply(trace: vf.Trace) -> str:
    messages = trace.assistant_messages
    return (messages[-1].content or "") if messages else ""


class SumsTaskset(vf.Taskset[SumsTask, vf.TasksetConfig]):
    """The 100 sums of two digits 0-9, in a fixed shuffled order."""

    def load(self) -> Iterator[SumsTask]:
        pairs = [(a, b) for a in range(10) for b in range(10)]
        random.Random(0).shuffle(pairs)
        for a, b in pairs:
            data = SumsData(prompt=f"What is {a} + {b}? Answer with just the number.", answer=a + b)
            yield SumsTask(data, self.config.task)
