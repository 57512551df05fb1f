"""A reward's name, as `rewards` in the config gives it, made the function gspo calls: a built-in
(gspo.rewards.builtins), the configured reward model (``reward_model``) or LLM judge (``judge``), or your own
code, ``"module:function"`` or ``"path/file.py:function"`` (imported only under the trust rules of
gspo.run.trust)."""

from __future__ import annotations

import difflib
import os
from typing import Any

import torch

from gspo.config import Config
from gspo.rewards.builtins import BUILTIN_REWARDS
from gspo.rewards.calling import RewardFunction
from gspo.rollout.user_code import load_function

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
