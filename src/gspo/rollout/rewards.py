"""Reward functions: plain callables, their built-ins, and the checked call that combines several.

A reward function takes ``prompts``, ``completions`` and ``**fields`` (lists aligned with one another; every
``Example.fields`` key arrives as a keyword list) and returns one float per completion. Functions accept
``**_`` so that fields meant for other functions pass through. A function that names a ``completions``
parameter (``def f(prompts, completions, **_)``, TRL's ``def reward_len(completions, **kwargs)``), or takes
keywords only, is called with keywords, as TRL calls it; any other (``lambda p, c, **_: ...``) positionally,
``f(prompts, completions, **fields)`` (`keyword_call` decides once, from the signature). A function may carry a
``validate_example(fields)`` attribute raising ValueError for an example it cannot score (``correct_number``:
an answer that is not a number); the trainer calls it on every example at start-up. ``with_timeout`` gives
each call a deadline (the trainer's ``reward_timeout``).

Numbers in completions (``correct_number``, ``number_format``) are decimal: an optional ``-``, digits, an
optional fraction (``3.5``; ``.5`` and ``3.`` are not fractions), and thousands written either plainly
(``1000``) or with commas in groups of three (``1,000``; ``1,00`` reads as ``1`` and ``00``, and a list
written "1,234" as 1234). A ``-`` right after a digit is an operator: "5-3" holds 5 and 3. Values are compared
exactly with :class:`decimal.Decimal`, so ``"12.0"`` equals ``12``. Scientific notation, words
("twelve") and fractions ("1/2") are not read.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import numbers
import re
import threading
from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import Any

import torch

from gspo.rollout.reasoning_gym import scorer
from gspo.rollout.user_code import load_function, raised, raised_where

__all__ = [
    "BUILTIN_REWARDS",
    "RewardError",
    "RewardFunction",
    "compute_rewards",
    "correct_number",
    "exact_answer",
    "extract_answer",
    "keyword_call",
    "number_format",
    "reasoning_gym",
    "resolve_reward",
    "with_timeout",
]

RewardFunction = Callable[..., list[float]]

_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
# Not after a digit, so "5-3" reads as 5 and 3 rather than 5 and -3; not after a ".", so ".5" is not
# misread as 5 (it is not read at all).
_NUMBER_IN_TEXT = re.compile(rf"(?<![\d.]){_NUMBER}")
_BARE_NUMBER = re.compile(rf"{_NUMBER}\.?")
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


class RewardError(RuntimeError):
    """A reward function failed or returned something unusable; the message names it and the sample."""


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


def number_format(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """1.0 where the completion is a bare number (whitespace and one trailing period allowed), else 0.0.

    >>> number_format(["What is 5 + 7?"] * 4, ["12", " -1,000.\\n", "12 apples", "twelve"])
    [1.0, 1.0, 0.0, 0.0]
    """
    return [float(_BARE_NUMBER.fullmatch(completion.strip()) is not None) for completion in completions]


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


def _excerpt(completion: str) -> str:
    return repr(completion[:80]) + ("..." if len(completion) > 80 else "")


def _call_one(
    name: str, function: RewardFunction, prompts: list[str], completions: list[str], fields: dict[str, list]
) -> list[float]:
    try:
        return function(prompts, completions, **fields)
    except RewardError:  # a timeout: calling it again per sample would only hang again
        raise
    except (Exception, SystemExit) as batch_error:  # sys.exit in a reward is its failure, not gspo's exit
        # The batch call does not say which sample broke it: retry one sample at a time to find out.
        for index in range(len(completions)):
            single_fields = {key: values[index : index + 1] for key, values in fields.items()}
            try:
                function(prompts[index : index + 1], completions[index : index + 1], **single_fields)
            except (Exception, SystemExit) as error:
                raise RewardError(
                    f"reward function {name!r} {raised(error)} at sample {index} "
                    f"(completion {_excerpt(completions[index])}){raised_where(error, function)}"
                ) from error
        raise RewardError(
            f"reward function {name!r} {raised(batch_error)} on the batch of {len(completions)} "
            f"samples, though no single sample raises alone{raised_where(batch_error, function)}"
        ) from batch_error


def _check_values(name: str, values: Any, completions: list[str]) -> list[float]:
    if hasattr(values, "tolist"):  # tensors and numpy arrays
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise RewardError(
            f"reward function {name!r} returned {type(values).__name__}, expected a list of "
            f"{len(completions)} floats (one per completion)"
        )
    if len(values) != len(completions):
        raise RewardError(
            f"reward function {name!r} returned {len(values)} values for {len(completions)} completions"
        )
    for index, value in enumerate(values):
        if isinstance(value, bool):  # a bool is an int to Python, but "passed?" is no amount of reward
            raise RewardError(
                f"reward function {name!r} returned {value!r} at sample {index} "
                f"(completion {_excerpt(completions[index])}); rewards are numbers, not booleans: return "
                "1.0 or 0.0 (float(passed))"
            )
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardError(
                f"reward function {name!r} returned {value!r} at sample {index} "
                f"(completion {_excerpt(completions[index])}); rewards must be finite numbers"
            )
        if abs(value) > _FLOAT32_MAX:
            raise RewardError(
                f"reward function {name!r} returned {value!r} at sample {index} "
                f"(completion {_excerpt(completions[index])}), beyond float32's range (about 3.4e38), "
                "in which rewards are combined; return smaller values"
            )
    return [float(value) for value in values]


def compute_rewards(
    functions: Sequence[tuple[str, RewardFunction, float]],
    prompts: list[str],
    completions: list[str],
    fields: dict[str, list],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Call each reward function on the batch and combine: ``(total, {name: rewards})``.

    ``functions`` holds ``(name, function, weight)``; every list (prompts, each field) is aligned with
    ``completions``, B long. Returns float32 tensors:

        total = sum_k weight_k * r_k    (B,)
        r_k                             (B,)

    A function that raises, returns a non-finite or non-numeric value, or the wrong number of values gives a
    :class:`RewardError` naming it (and the sample, where there is one). To find the sample behind an
    exception, the function is called again one sample at a time.
    """
    if not functions:
        raise ValueError("compute_rewards needs at least one reward function")
    names = [name for name, _, _ in functions]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"reward names must be unique, repeated: {duplicates}")
    for name, _, weight in functions:
        if not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise ValueError(f"reward {name!r} has weight {weight!r}; weights must be finite numbers")
    for key, values in {"prompts": prompts, **fields}.items():
        if len(values) != len(completions):
            raise ValueError(f"{key!r} has {len(values)} entries for {len(completions)} completions")

    total = torch.zeros(len(completions), dtype=torch.float32)
    per_function = {}
    for name, function, weight in functions:
        values = _check_values(name, _call_one(name, function, prompts, completions, fields), completions)
        rewards = torch.tensor(values, dtype=torch.float32)
        per_function[name] = rewards
        total += float(weight) * rewards
    if not torch.isfinite(total).all():
        raise RewardError(
            f"the weighted sum of the rewards {names} overflows float32 at sample "
            f"{int((~torch.isfinite(total)).nonzero()[0])}: lower the weights or the rewards"
        )
    return total, per_function


def keyword_call(function: RewardFunction) -> RewardFunction:
    """``function`` as ``f(prompts, completions, **fields)``, the one call compute_rewards makes, forwarded by
    keyword when the function names a ``completions`` parameter or takes keywords only (TRL's contract:
    ``reward_len(completions, **kwargs)`` gets ``prompts=`` in its kwargs), else positionally as before: a
    function whose positions are its own names (``lambda p, c, **_``), or that reads ``*args``. The
    signature is read once, here; a callable without one is called positionally.

    >>> def reward_len(completions, **kwargs):
    ...     return [-abs(3 - len(c)) for c in completions]
    >>> keyword_call(reward_len)(["p"], ["abcd"])
    [-1]
    """
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # some builtins and C callables have no signature to read
        return function
    named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    positional = [
        p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    if "completions" not in named and positional:
        return function

    @functools.wraps(function)  # keeps validate_example and the signature check_examples reads
    def call(prompts: list[Any], completions: list[Any], **fields: Any) -> Any:
        return function(prompts=prompts, completions=completions, **fields)

    return call


def with_timeout(function: RewardFunction, seconds: float, name: str) -> RewardFunction:
    """``function`` with a deadline of ``seconds`` per call (0: none): a call still running then raises
    RewardError.

    Python cannot stop a running function from outside, so each call runs in a daemon thread that is
    abandoned at the deadline: it ends with the process (the run stops with the error, after a
    checkpoint). A function that needs the main thread (signal handlers) needs ``seconds=0``.
    """
    if not seconds:
        return function

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        outcome: dict[str, Any] = {}

        def target() -> None:
            try:
                outcome["value"] = function(*args, **kwargs)
            except BaseException as error:  # handed to the caller's thread
                outcome["error"] = error

        thread = threading.Thread(target=target, name=f"gspo-reward-{name}", daemon=True)
        thread.start()
        thread.join(seconds)
        if thread.is_alive():
            raise RewardError(
                f"reward function {name!r} did not return within {seconds:g} s (reward_timeout): it may "
                "hang (a network call, a subprocess, an endless loop); fix it, or raise reward_timeout "
                "if it needs longer"
            )
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    return call


def resolve_reward(name_or_path: str) -> RewardFunction:
    """A reward function from a built-in name, ``"package.module:function"`` or ``"path/file.py:function"``.

    >>> resolve_reward("correct_number") is correct_number
    True
    """
    if name_or_path in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name_or_path]
    if ":" not in name_or_path:
        close = difflib.get_close_matches(name_or_path, BUILTIN_REWARDS, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"unknown reward {name_or_path!r}: built-ins are {sorted(BUILTIN_REWARDS)}, or give "
            f"'module:function' or 'path/to/file.py:function'{hint}"
        )

    return load_function(name_or_path, "reward")
