"""Reward functions of the capitals task: plain Python, one float per completion.

gspo calls each function once per rollout batch as ``f(prompts, completions, **fields)``:
  prompts      the prompts as the model saw them (chat template applied), one per completion;
  completions  the decoded completions (special tokens removed), B of them;
  fields       every column named in task.answer_fields, as a keyword list aligned with the completions
               (here ``answer``). Take ``**_`` so that columns meant for other functions pass through.
It returns B finite numbers. The run's reward is the weighted sum over config.rewards; the first function
alone, averaged over the held-out problems (greedy completions), is the "accuracy" gspo reports.
"""

from __future__ import annotations

import re
from typing import Any


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def exact_capital(prompts: list[str], completions: list[str], *, answer: list[str], **_: Any) -> list[float]:
    """1.0 when the completion is just the city (case, spacing and punctuation aside), else 0.0.

    >>> exact_capital(["..."] * 3, ["Paris", " paris.", "The capital is Paris."], answer=["Paris"] * 3)
    [1.0, 1.0, 0.0]
    """
    return [float(_words(c) == _words(a)) for c, a in zip(completions, answer, strict=True)]


def names_capital(prompts: list[str], completions: list[str], *, answer: list[str], **_: Any) -> list[float]:
    """1.0 when the completion's first sentence names the city, else 0.0: the answer is right, whatever its
    form ("Paris." and "The capital of France is Paris." both count). A list of cities would count too;
    exact_capital's weight makes the bare city the better answer.

    >>> names_capital(["..."] * 4, ["Paris", "It is Paris.", "Lyon. Paris?", "paris"], answer=["Paris"] * 4)
    [1.0, 1.0, 0.0, 1.0]
    """
    rewards = []
    for completion, city in zip(completions, answer, strict=True):
        words, target = _words(re.split(r"[.!?\n]", completion, maxsplit=1)[0]), _words(city)
        found = any(words[i : i + len(target)] == target for i in range(len(words) - len(target) + 1))
        rewards.append(float(found))
    return rewards
