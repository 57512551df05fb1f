"""A run's rewards resolved once, from the config's `rewards` or functions given in Python
(`resolve_rewards`: a `gspo.rewards.scoring.Rewards`), and each reward's name made the function gspo calls
(`resolve_reward`): a built-in (gspo.rewards.builtins), the configured reward model (``reward_model``) or
LLM judge (``judge``), or your own code, ``"module:function"`` or ``"path/file.py:function"`` (imported only
under the trust rules of gspo.run.trust). `check_examples` checks every example against the rewards that
read it, at start-up."""

from __future__ import annotations

import difflib
import inspect
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from gspo.config import Config, ConfigError
from gspo.config.loading import code_file
from gspo.config.values import shown
from gspo.models.loading import ModelError
from gspo.rewards.builtins import BUILTIN_REWARDS
from gspo.rewards.calling import KEYWORDS, RewardFunction
from gspo.rewards.scoring import Rewards
from gspo.rollout.data import DataError, Example
from gspo.rollout.user_code import CodeFileError, load_function

CONFIGURED = ("reward_model", "judge")
"""The rewards the config's own sections describe (reward_model.*, judge.*)."""


def resolve_reward(
    name_or_path: str, config: Config | None = None, *, device: torch.device | str = "cpu"
) -> RewardFunction:
    """The reward function of a name (module docstring); ``config``'s reward_model and judge sections build
    those two, on ``device`` for the reward model.

    >>> resolve_reward("correct_number").__name__
    'correct_number'
    """
    if name_or_path in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name_or_path]
    if name_or_path in CONFIGURED:
        if config is None:
            raise ValueError(f"the reward {name_or_path!r} is built from the config's {name_or_path} section")
        return configured(name_or_path, config, device)
    if ":" not in name_or_path:
        choices = sorted([*BUILTIN_REWARDS, *CONFIGURED])
        close = difflib.get_close_matches(name_or_path, choices, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"unknown reward {name_or_path!r}: built-ins are {choices}, or give 'module:function' or "
            f"'path/to/file.py:function'{hint}"
        )
    return load_function(name_or_path, "reward")


def configured(name: str, config: Config, device: torch.device | str) -> Any:
    """The reward model or the judge, as their sections set them (checked by gspo.config.checks)."""
    if name == "reward_model":
        from gspo.rewards.models import RewardModel

        section = config.reward_model
        return RewardModel(
            section.path, device=device, batch_size=section.batch_size, max_length=section.max_length
        )
    from gspo.rewards.judge import Judge

    judge = config.judge
    key = os.environ.get(judge.api_key_env) or None  # never written to a file: read here, when it is used
    return Judge(
        judge.url,
        judge.template,
        model=judge.model,
        api_key=key,
        max_tokens=judge.max_tokens,
        temperature=judge.temperature,
        response_format=judge.response_format,
        concurrency=config.reward_concurrency,
    )


RewardFunctions = Mapping[str, RewardFunction] | Sequence[RewardFunction] | RewardFunction
"""Python reward functions: by name, or a list (or one) named by their own names, as TRL's reward_funcs."""


def named_rewards(functions: RewardFunctions | None) -> dict[str, RewardFunction]:
    """`functions` by name: a mapping as it is, a list of functions (or one) by each function's __name__;
    None: {} (the config's rewards). Anything else, an empty collection (a run with no reward), a name that
    is not a function's own (a lambda's, a partial's), a repeated name, or an item that is not callable is a
    ConfigError naming the item and the fix."""
    if functions is None:
        return {}
    if isinstance(functions, Mapping):
        named = dict(functions)
    elif isinstance(functions, (str, bytes)):
        raise ConfigError(_named_not_given(functions, "reward_functions"))
    elif not callable(functions) and not isinstance(functions, Iterable):
        raise ConfigError(
            f"reward_functions={shown(functions)} ({type(functions).__name__}) is not a function, a list of "
            "functions, or a dict of them by name: give one of those (None: the config's rewards)"
        )
    else:
        listed = [functions] if callable(functions) else list(functions)
        named = {}
        for index, function in enumerate(listed):
            if isinstance(function, torch.nn.Module):  # a reward model: TRL takes one, gspo does not
                raise ConfigError(_model_given(function, f"reward_functions[{index}]"))
            name = getattr(function, "__name__", None) if callable(function) else None
            if callable(function) and name in (None, "<lambda>"):
                what = "a lambda" if name else f"a {type(function).__name__}"
                raise ConfigError(
                    f"reward_functions[{index}] is {what}, which has no name of its own: name it with a "
                    "dict, reward_functions={'my_reward': f, ...}"
                )
            if name in named:
                raise ConfigError(
                    f"reward_functions[{index}]: two functions are named {name!r} (metrics and the eval "
                    "accuracy name each reward): name them with a dict, reward_functions={'a': f, 'b': g}"
                )
            named[name or index] = function
    if not named:  # the run's rewards are exactly the functions given: here, none
        raise ConfigError(
            f"reward_functions={shown(functions)} is empty: a run needs a reward; give your functions, or leave "
            "reward_functions out (None) to use the config's rewards"
        )
    for name, function in named.items():
        if isinstance(function, torch.nn.Module):
            raise ConfigError(_model_given(function, f"reward_functions[{name!r}]"))
        if not callable(function):
            raise ConfigError(_named_not_given(function, f"reward_functions[{name!r}]"))
    return named


def _model_given(model: torch.nn.Module, where: str) -> str:
    return (
        f"{where} is a model ({type(model).__name__}): gspo's rewards are functions, def reward(completions, "
        "**kwargs) -> list[float]; score with the model inside one"
    )


def _named_not_given(value: object, where: str) -> str:
    """The message for a reward given by name where functions go: a built-in's name or a file's function
    belongs in config.rewards; a hub id (a reward model, as TRL takes) has no place in gspo."""
    if not isinstance(value, str):
        return (
            f"{where} is a {type(value).__name__}, not a function: a built-in or a file's function goes in "
            "config.rewards (e.g. rewards={'exact_answer': 1.0})"
        )
    if "/" in value and ":" not in value:  # "OpenAssistant/reward-model-deberta-v3-large-v2"
        return (
            f"{where}={value!r} names a model: gspo's rewards are functions, def reward(completions, **kwargs) "
            "-> list[float]; score with the model inside one (a reward model is not taken by name)"
        )
    return (
        f"{where}={value!r} is a name: reward_functions takes the functions themselves; a built-in or a "
        f"file's function goes in config.rewards (e.g. rewards={{{value!r}: 1.0}})"
    )


def resolve_rewards(
    config: Config, custom: RewardFunctions | None, *, device: torch.device | str = "cpu"
) -> Rewards:
    """The run's rewards, in order (the first is the eval accuracy), resolved once for training, evaluation
    and gspo.trl. Each function is prepared (gspo.rewards.calling.prepare): called as it is declared, each
    call within reward_timeout, at most reward_concurrency of a concurrent one's in flight; a reward model
    runs on ``device``.

    `custom` (Python callables: by name, or a list named by their own names) replaces config.rewards, as
    TRL's reward_funcs do: the run's rewards are exactly these, each weighing config.rewards[name] where the
    config names it, else 1.0.
    """
    custom = named_rewards(custom)
    weights = {name: config.rewards.get(name, 1.0) for name in custom} if custom else dict(config.rewards)
    labels = {name: name for name in custom} if custom else reward_labels(list(weights))
    resolved = []
    for name, weight in weights.items():
        try:
            function = custom[name] if name in custom else resolve_reward(name, config, device=device)
        except ModelError:  # the reward model's folder: its own one line, naming what was found
            raise
        except (CodeFileError, FileNotFoundError) as error:  # the file: missing, or failing when run
            where = " (read from the working directory when named on the command line, else from the folder of the config file that names it)"
            missing = where if isinstance(error, FileNotFoundError) else ""
            raise CodeFileError(f"{as_written(name, error)}{missing}") from error
        except (ValueError, TypeError, ImportError) as error:  # unknown name, no such function, ...
            raise ConfigError(as_written(name, error)) from error
        except (Exception, SystemExit) as error:  # a module (module:function) that fails when imported
            doing = f"building it from its {name} section" if name in CONFIGURED else "importing it"
            raise CodeFileError(f"rewards.{name}: {doing} raised {type(error).__name__}: {error}") from error
        resolved.append((labels[name], function, weight))
    return Rewards.of(resolved, timeout=config.reward_timeout, concurrency=config.reward_concurrency)


def as_written(name: str, error: BaseException) -> str:
    """ "rewards.KEY: error" for a reward that failed to load, its file's path as the user most likely wrote
    it: relative to the working directory when the file lies inside it (loading made it absolute)."""
    file = code_file(name)
    text = str(error)
    if file is not None and file.is_absolute() and file.is_relative_to(Path.cwd()):
        relative = str(file.relative_to(Path.cwd()))
        name, text = name.replace(str(file), relative, 1), text.replace(str(file), relative)
    return f"rewards.{name}: {text}"


def reward_labels(names: list[str]) -> dict[str, str]:
    """Each configured reward's name in metrics, reports and messages: its function's name, as TRL names
    them ("reward/exact_capital", not the file's absolute path), or the whole key where two share one.

    >>> reward_labels(["correct_number", "/tasks/capitals/rewards.py:exact_capital"])
    {'correct_number': 'correct_number', '/tasks/capitals/rewards.py:exact_capital': 'exact_capital'}
    """
    short = {name: name.rpartition(":")[2] for name in names}
    counts = {label: list(short.values()).count(label) for label in short.values()}
    return {name: label if counts[label] == 1 else name for name, label in short.items()}


def check_examples(rewards: Rewards, examples: list[Example]) -> None:
    """Every example has the fields each reward function needs (its keyword-only parameters without a
    default) and passes the function's own `validate_example`, if any: found at start-up, not when the
    row is first drawn."""
    for reward in rewards:
        name, function = reward.name, reward.function
        try:
            parameters = inspect.signature(function).parameters.values()
        except (TypeError, ValueError):  # some callables have no signature to read
            parameters = []
        needed = [
            p.name
            for p in parameters
            if p.kind is p.KEYWORD_ONLY and p.default is p.empty and p.name not in KEYWORDS  # gspo's own
        ]
        validate = getattr(function, "validate_example", None)
        for index, example in enumerate(examples):
            where = example.source or f"example {index} ({example.prompt[:60]!r})"
            missing = [field for field in needed if field not in example.fields]
            if missing:
                raise DataError(
                    f"{where}: reward {name!r} needs the field(s) {missing}, and the example has "
                    f"{sorted(example.fields)} (set task.answer_fields)"
                )
            if validate is not None:
                try:
                    validate(example.fields)
                except ValueError as error:
                    raise DataError(f"{where}: {error}, which reward {name!r} cannot use") from None
