"""reasoning-gym as a task source: its procedural problems as examples, its own scorers as the reward.

``reasoning_gym_task`` draws problems from one reasoning-gym dataset (``task.dataset``, with the settings
``task.dataset_config``); ``scorer`` is that dataset's own ``score_answer``.
reasoning-gym is optional (``pip install 'gspo[reasoning]'``) and imported only here, when first used.

Seeding: reasoning-gym generates item ``i`` of a dataset seeded ``s`` from ``Random(s + i)`` (most
generators), so datasets seeded ``s`` and ``s + 1`` share all but one item. All problems of a task therefore
come from ONE dataset seeded ``task.seed``, items 0, 1, 2, ... in order, keeping each question the first time
it appears; the train / held-out split (``split_eval``, as for the other built-in tasks) then cuts a list
without repeats, so no held-out question is a training question.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import importlib
import json
from typing import Any

from gspo.config.schema import ConfigError
from gspo.rollout.data import Example

__all__ = ["ANSWER_FORMAT", "dataset_names", "reasoning_gym_task", "scorer"]

ANSWER_FORMAT = "Think step by step, then give your final answer inside <answer></answer> tags."
"""Appended to every question (after a blank line), as reasoning-gym's own default system prompt asks: the
reward reads the last <answer> block, else the completion's last non-empty line
(gspo.rewards.builtins.extract_answer)."""

# Items drawn per problem asked for (plus a constant) before giving up on finding enough distinct
# questions: enough for a problem space twice the size asked for (coupon collector: ~1.4 draws each).
_DRAWS_PER_PROBLEM = 4
_EXTRA_DRAWS = 100
# Set by gspo from task.seed and the number of problems, never by the user.
_OWN_SETTINGS = {"seed": "task.seed", "size": "task.num_train and task.num_eval"}


def _registry() -> dict[str, tuple[type, type]]:
    """reasoning-gym's datasets: name -> (dataset class, config dataclass)."""
    try:
        factory = importlib.import_module("reasoning_gym.factory")
        importlib.import_module("reasoning_gym")  # registers every dataset in factory.DATASETS
    except ImportError as error:
        raise ImportError(
            f"task.name=reasoning_gym and the reasoning_gym reward need reasoning-gym ({error}): "
            "pip install 'gspo[reasoning]'"
        ) from error
    return factory.DATASETS


def dataset_names() -> list[str]:
    """The names reasoning-gym's ``create_dataset`` knows, sorted."""
    return sorted(_registry())


def _config_class(dataset: str) -> type:
    registry = _registry()
    if dataset not in registry:
        close = difflib.get_close_matches(dataset, registry, n=3, cutoff=0.6)
        hint = (
            f"did you mean {', '.join(map(repr, close))}?" if close else f"its datasets: {sorted(registry)}"
        )
        raise ConfigError(f"task.dataset={dataset!r} is not a reasoning-gym dataset; {hint}")
    return registry[dataset][1]


def _defaults(config_class: type) -> dict[str, Any]:
    """The user-settable settings of a dataset's config dataclass, with their defaults."""
    defaults = {}
    for f in dataclasses.fields(config_class):
        if f.name in _OWN_SETTINGS:
            continue
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = f.default_factory()
        else:
            defaults[f.name] = "(required)"
    return defaults


def _show(value: Any) -> str:
    return repr(value.value) if isinstance(value, enum.Enum) else repr(value)


def _settings_text(dataset: str, defaults: dict[str, Any]) -> str:
    return f"{dataset}'s settings (defaults): " + ", ".join(f"{k}={_show(v)}" for k, v in defaults.items())


def _coerce_setting(name: str, value: Any, default: Any, dataset: str, defaults: dict[str, Any]) -> Any:
    """``value`` as the type of the setting's default (YAML lists become tuples where the default is one,
    strings become enum members); types with no YAML form (dates, nested records) pass as given, for
    reasoning-gym's own checks."""

    def wrong(expected: str) -> ConfigError:
        return ConfigError(
            f"task.dataset_config.{name}: expected {expected} (the default is {_show(default)}), got {value!r}; "
            + _settings_text(dataset, defaults)
        )

    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise wrong("true or false")
    elif isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong("an integer")
    elif isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise wrong("a number")
        return float(value)
    elif isinstance(default, enum.Enum):
        choices = [member.value for member in type(default)]
        if value not in choices:
            raise wrong(f"one of {choices}")
        return type(default)(value)
    elif isinstance(default, str):
        if not isinstance(value, str):
            raise wrong("a string")
    elif isinstance(default, (tuple, list)):
        if not isinstance(value, (tuple, list)):
            raise wrong("a list")
        return type(default)(value)
    return value


def _make_dataset(dataset: str, dataset_config: dict[str, Any], *, seed: int, size: int) -> Any:
    """reasoning-gym's dataset object, every setting checked: errors name the setting and list the valid
    ones."""
    config_class = _config_class(dataset)
    defaults = _defaults(config_class)
    settings = {}
    for name, value in dataset_config.items():
        if name in _OWN_SETTINGS:
            raise ConfigError(
                f"task.dataset_config.{name}: gspo sets it from {_OWN_SETTINGS[name]}; remove it from "
                "task.dataset_config"
            )
        if name not in defaults:
            close = difflib.get_close_matches(name, defaults, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"task.dataset_config.{name} is not a setting of {dataset!r}; {hint}"
                + _settings_text(dataset, defaults)
            )
        settings[name] = _coerce_setting(name, value, defaults[name], dataset, defaults)
    dataset_class = _registry()[dataset][0]
    try:
        config = config_class(**settings, seed=seed, size=size)
        return dataset_class(config=config)  # ProceduralDataset.__init__ runs the config's validate()
    except (AssertionError, ValueError, TypeError) as error:
        raise ConfigError(
            f"task.dataset_config={dataset_config}: reasoning-gym rejects it for {dataset!r}: {error or 'an assertion failed'}; "
            + _settings_text(dataset, defaults)
        ) from error


def reasoning_gym_task(
    num_examples: int, *, dataset: str, dataset_config: dict[str, Any] | None = None, seed: int = 0
) -> list[Example]:
    """``num_examples`` problems of a reasoning-gym dataset, distinct questions, deterministic per seed.

    The prompt is the question, a blank line and ``ANSWER_FORMAT``. ``fields`` (the reward's keyword
    arguments) hold ``answer`` (the reference answer, a string), ``entry`` (reasoning-gym's item: question,
    answer, metadata), ``dataset`` and ``dataset_config`` (which scorer to use). Problems are items 0, 1, ...
    of the dataset seeded ``seed``, repeats skipped (module docstring).
    """
    if num_examples < 0:
        raise ValueError(f"reasoning_gym_task: num_examples must be >= 0, got {num_examples}")
    dataset_config = dict(dataset_config or {})
    draws = _DRAWS_PER_PROBLEM * num_examples + _EXTRA_DRAWS
    source = _make_dataset(dataset, dataset_config, seed=seed, size=draws)
    examples: dict[str, Example] = {}
    for index in range(draws):
        if len(examples) == num_examples:
            break
        try:
            entry = source[index]
        except Exception as error:  # a generator that fails on some settings, e.g. an impossible range
            raise ConfigError(
                f"task.dataset_config={dataset_config}: reasoning-gym's {dataset!r} failed to generate item "
                f"{index}: {type(error).__name__}: {error}"
            ) from error
        question = entry["question"]
        if question not in examples:
            fields = {
                "answer": entry["answer"],
                "entry": entry,
                "dataset": dataset,
                "dataset_config": dataset_config,
            }
            examples[question] = Example(f"{question.rstrip()}\n\n{ANSWER_FORMAT}", fields)
    if len(examples) < num_examples:
        raise ConfigError(
            f"task: reasoning-gym's {dataset!r} gave {len(examples)} distinct questions in {draws} draws, "
            f"fewer than the {num_examples} asked for (task.num_train + task.num_eval): widen its settings "
            "(task.dataset_config) or ask for fewer problems"
        )
    return list(examples.values())


_SCORERS: dict[str, Any] = {}


def scorer(dataset: str, dataset_config: dict[str, Any]) -> Any:
    """The dataset's own ``score_answer(answer, entry) -> float``, built once per dataset and settings.

    Some scorers read the dataset's settings (decimal_arithmetic's decimal places, time_intervals'
    tolerances), so the dataset is built as the problems were; seed and size play no part in scoring.
    """
    key = dataset + json.dumps(dataset_config, sort_keys=True, default=repr)
    if key not in _SCORERS:
        _SCORERS[key] = _make_dataset(dataset, dataset_config, seed=0, size=1).score_answer
    return _SCORERS[key]
