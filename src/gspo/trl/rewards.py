"""Reward functions as GRPOTrainer takes them and calls them: TRL's reward_funcs (functions by their names, a
reward model by its folder or hub id), each function called as TRL calls it (`trl_call`), and the rewards
gspo={'rewards': ...} names."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerState

from gspo.config import Config, ConfigError
from gspo.config.values import shown
from gspo.models.loading import hub_snapshot
from gspo.rewards.resolve import resolve_reward

RewardFunc = Callable[..., Any]

GSPO_ONLY = ("group_ids", "example_prompts")
"""Keywords gspo passes its own reward functions that TRL's do not expect."""
TRL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra")


def _log_extra(column: str, values: list[Any]) -> None:
    """TRL's log_extra (a column of the completions table): taken and ignored (gspo.trl's docstring)."""


def trl_call(function: RewardFunc, conversational: bool, updates: int) -> RewardFunc:
    """`function` called as TRL calls it: `prompts` are the dataset's own (the prompt column, which the run
    passes among the fields; gspo's are the templated texts), completions of a conversational dataset are
    assistant messages, `trainer_state.global_step` counts optimizer updates (`updates` per gspo step), the
    other columns and TRL's keywords come as keywords, gspo's own (`GSPO_ONLY`) never; only those it takes
    when it has no **kwargs. An async function stays async; its attributes (gspo.reward's) stay."""
    parameters = _parameters(function)
    takes = None if any(p.kind is p.VAR_KEYWORD for p in parameters) else {p.name for p in parameters}

    def arguments(prompts: list[Any], completions: list[Any], fields: dict[str, Any]) -> dict[str, Any]:
        prompts = fields.pop("prompt", prompts)
        for name in GSPO_ONLY:
            fields.pop(name, None)
        if conversational:
            completions = [[{"role": "assistant", "content": text}] for text in completions]
        if "trainer_state" in fields:  # gspo's step s is drawn after s - 1 steps of `updates` each
            step = fields["trainer_state"].global_step
            fields["trainer_state"] = TrainerState(global_step=max(0, step - 1) * updates)
        values = {"prompts": prompts, "completions": completions, "log_extra": _log_extra, **fields}
        return values if takes is None else {k: v for k, v in values.items() if k in takes}

    if _is_async(function):

        @functools.wraps(function)
        async def call(prompts: list[Any], completions: list[Any], **fields: Any) -> Any:
            return await function(**arguments(prompts, completions, fields))

    else:

        @functools.wraps(function)
        def call(prompts: list[Any], completions: list[Any], **fields: Any) -> Any:  # type: ignore[misc]
            return function(**arguments(prompts, completions, fields))

    # gspo reads this signature, not the function's: it passes every keyword, and checks at start-up that each
    # row has the columns the function requires (its keyword-only parameters without a default)
    required = [
        p
        for p in parameters
        if p.kind is p.KEYWORD_ONLY and p.default is p.empty and p.name not in (*TRL_KEYWORDS, *GSPO_ONLY)
    ]
    call.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            inspect.Parameter("prompts", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            inspect.Parameter("completions", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            *required,
            inspect.Parameter("fields", inspect.Parameter.VAR_KEYWORD),
        ]
    )
    return call


def _parameters(function: RewardFunc) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # a callable without a signature to read: give it every keyword
        return [inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)]


def _is_async(function: RewardFunc) -> bool:
    target = function.__call__ if not inspect.isroutine(function) else function
    return inspect.iscoroutinefunction(target)


def split_reward_funcs(reward_funcs: Any) -> tuple[dict[str, RewardFunc], str | None]:
    """The reward functions by their names, and the reward model's folder (a str of reward_funcs: a folder,
    or a hub id in the local Hugging Face cache), as TRL takes them."""
    listed = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    functions: dict[str, RewardFunc] = {}
    models = []
    for index, item in enumerate(listed):
        where = f"reward_funcs[{index}]" if isinstance(reward_funcs, (list, tuple)) else "reward_funcs"
        if isinstance(item, (str, Path)):
            models.append(_reward_model_path(str(item), where))
        elif isinstance(item, torch.nn.Module):
            raise ConfigError(
                f"{where} is a model object ({type(item).__name__}): gspo loads a reward model from its folder; "
                f"save it (model.save_pretrained(DIR), its tokenizer too) and give {where}=DIR"
            )
        elif not callable(item):
            raise ConfigError(
                f"{where}={shown(item)}: a reward is a function, def reward(completions, **kwargs) -> list[float], "
                "or a reward model's folder"
            )
        else:
            name = getattr(item, "__name__", None)
            if name in (None, "<lambda>"):
                what = "a lambda" if name else f"a {type(item).__name__}"
                raise ConfigError(
                    f"{where} is {what}, which has no name of its own: TRL names each reward by its function's "
                    "name; define it with def"
                )
            if name in functions or name == "reward_model":
                raise ConfigError(
                    f"{where}: two rewards are named {name!r} (metrics and the eval accuracy name each reward): "
                    "rename one of the functions"
                )
            functions[name] = item
    if len(models) > 1:
        raise ConfigError(f"reward_funcs names {len(models)} reward models: gspo scores with one, keep one")
    if not functions and not models:
        raise ConfigError(
            "GRPOTrainer needs reward_funcs: a function, def reward(completions, **kwargs) -> list[float]"
        )
    return functions, (models[0] if models else None)


def _reward_model_path(value: str, where: str) -> str:
    """A reward model's folder: the path, or a hub id's snapshot in the local Hugging Face cache."""
    if Path(value).exists():
        return os.path.abspath(value)
    snapshot = hub_snapshot(value)
    if snapshot is not None:
        return str(snapshot)
    raise ConfigError(
        f"{where}={value!r} is no folder, and the Hugging Face cache holds no model {value!r}: gspo downloads "
        f"nothing; fetch it once with `hf download {value}`, or give the folder of a sequence-classification model"
    )


def named_reward(name: str, config: Config) -> Any:
    """A reward gspo={'rewards': ...} names (a built-in, or a file's function), as the config resolves it."""
    try:
        return resolve_reward(name, config)
    except (ValueError, TypeError, ImportError, OSError) as error:
        raise ConfigError(f"GRPOConfig(gspo={{'rewards': {{{name!r}: ...}}}}): {error}") from None
