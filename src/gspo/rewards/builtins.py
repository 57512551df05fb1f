"""The built-in reward functions: a number's exactness, its format, reasoning-gym's own scorers.

Numbers in completions (``correct_number``, ``number_format``) are decimal: an optional ``-``, digits, an
optional fraction (``3.5``; ``.5`` and ``3.`` are not fractions), and thousands written either plainly
(``1000``) or with commas in groups of three (``1,000``; ``1,00`` reads as ``1`` and ``00``, and a list
written "1,234" as 1234). A ``-`` right after a digit is an operator: "5-3" holds 5 and 3. Values are compared
exactly with :class:`decimal.Decimal`, so ``"12.0"`` equals ``12``. Scientific notation, words
("twelve") and fractions ("1/2") are not read.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

from gspo.rewards.calling import RewardFunction, reward
from gspo.rollout.reasoning_gym import scorer

_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
# Not after a digit, so "5-3" reads as 5 and 3 rather than 5 and -3; not after a ".", so ".5" is not
# misread as 5 (it is not read at all).
_NUMBER_IN_TEXT = re.compile(rf"(?<![\d.]){_NUMBER}")
_BARE_NUMBER = re.compile(rf"{_NUMBER}\.?")


def _to_decimal(text: str) -> Decimal:
    return Decimal(text.replace(",", ""))


def _answer_value(answer: Any) -> Decimal:
    match = re.fullmatch(_NUMBER, str(answer).strip())
    if match is None:
        raise ValueError(f"answer {answer!r} is not a number")
    return _to_decimal(match.group())


def last_number(text: str) -> Decimal | None:
    """The last number in ``text`` (see the module docstring for what counts), or None.

    >>> last_number("3 + 4 = 7, so the answer is 1,000.")
    Decimal('1000')
    >>> last_number("no digits") is None
    True
    """
    matches = _NUMBER_IN_TEXT.findall(text)
    return _to_decimal(matches[-1]) if matches else None


@reward(best=1.0)
def correct_number(prompts: list[str], completions: list[str], *, answer: list[Any], **_: Any) -> list[float]:
    """1.0 where the last number in the completion equals the answer, else 0.0.

    >>> correct_number(["What is 5 + 7?"] * 3, ["The answer is 12.", "12, no 13", "-12"], answer=["12"] * 3)
    [1.0, 0.0, 0.0]

    Answers may be strings or numbers; one that is not a number raises ValueError.
    """
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        value = last_number(completion)
        rewards.append(float(value is not None and value == _answer_value(expected)))
    return rewards


def _check_number_answer(fields: dict[str, Any]) -> None:
    if "answer" not in fields:
        raise ValueError("no field 'answer'")
    _answer_value(fields["answer"])


def _check_has_answer(fields: dict[str, Any]) -> None:
    if "answer" not in fields:
        raise ValueError("no field 'answer'")


# Checked on every example at start-up (a reward function may carry its own `validate_example`): a bad
# answer is found before training, not when its row is first drawn.
correct_number.validate_example = _check_number_answer  # type: ignore[attr-defined]


@reward(best=1.0)
def exact_answer(prompts: list[str], completions: list[str], *, answer: list[Any], **_: Any) -> list[float]:
    """1.0 where the completion, stripped of whitespace and one trailing period, is the answer; else 0.0.

    The comparison is on text (``str(answer)``, also stripped), case-sensitive.

    >>> exact_answer(["What is 5 + 7?"] * 3, [" 12.\\n", "The answer is 12.", "12.0"], answer=["12"] * 3)
    [1.0, 0.0, 0.0]
    """
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        text = completion.strip()
        text = text[:-1].rstrip() if text.endswith(".") else text
        rewards.append(float(text == str(expected).strip()))
    return rewards


@reward(best=1.0)
def number_format(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """1.0 where the completion is a bare number (whitespace and one trailing period allowed), else 0.0.

    >>> number_format(["What is 5 + 7?"] * 4, ["12", " -1,000.\\n", "12 apples", "twelve"])
    [1.0, 1.0, 0.0, 0.0]
    """
    return [float(_BARE_NUMBER.fullmatch(completion.strip()) is not None) for completion in completions]


@reward(best=1.0)
def digit_fraction(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """Share of the completion's non-space characters that are digits: a dense shaping reward toward a
    numeric answer (it gives a random model a signal; pair it with an answer reward).

    >>> digit_fraction(["What is 5 + 7?"] * 3, ["12", "1 apple", ""])
    [1.0, 0.16666666666666666, 0.0]
    """
    out = []
    for completion in completions:
        chars = [c for c in completion if not c.isspace()]
        out.append(sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0)
    return out


exact_answer.validate_example = _check_has_answer  # type: ignore[attr-defined]


_ANSWER_TAGS = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(completion: str) -> str:
    """The text inside the last ``<answer>...</answer>`` block, else the last non-empty line; stripped.

    >>> extract_answer("3 + 4 = 7\\n<answer> 7 </answer>\\nDone.")
    '7'
    >>> extract_answer("3 + 4 = 7\\nThe answer is 7.\\n\\n")
    'The answer is 7.'
    """
    blocks = _ANSWER_TAGS.findall(completion)
    if blocks:
        return blocks[-1].strip()
    lines = [line for line in completion.splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


@reward(best=1.0)
def reasoning_gym(
    prompts: list[str],
    completions: list[str],
    *,
    entry: list[dict[str, Any]],
    dataset: list[str],
    dataset_config: list[dict[str, Any]],
    **_: Any,
) -> list[float]:
    """reasoning-gym's own score of each answer (:func:`extract_answer`): its dataset's ``score_answer``.

    The fields come from task.name=reasoning_gym (gspo.rollout.reasoning_gym): ``entry`` is the problem's
    reasoning-gym item, ``dataset`` and ``dataset_config`` name the scorer. Scores are in [0, 1]; some
    datasets give partial credit (chain_sum: ``len(reference) / len(answer)`` when the answer contains the
    reference, so "<answer>The sum is 7</answer>" for 7 scores 1/12).
    """
    return [
        float(scorer(name, settings)(extract_answer(completion), item))
        for completion, item, name, settings in zip(completions, entry, dataset, dataset_config, strict=True)
    ]


def _check_reasoning_gym_fields(fields: dict[str, Any]) -> None:
    if not isinstance(fields.get("entry"), dict) or "answer" not in fields["entry"]:
        raise ValueError(
            "field 'entry' must be a reasoning-gym item (a mapping with 'question' and 'answer')"
        )
    scorer(fields["dataset"], fields["dataset_config"])  # an unknown dataset or setting: a ConfigError


reasoning_gym.validate_example = _check_reasoning_gym_fields  # type: ignore[attr-defined]

BUILTIN_REWARDS: dict[str, RewardFunction] = {
    "correct_number": correct_number,
    "exact_answer": exact_answer,
    "number_format": number_format,
    "digit_fraction": digit_fraction,
    "reasoning_gym": reasoning_gym,
}
