"""A run folder is data: its config.yaml may name reward code and a server, but gspo runs that code, and
sends requests and a key to that server, only when the user names them on the command line, or when the
user started that run, in that folder, with those very files (gspo.run.own_runs).

People share run folders the way they share checkpoints; whoever opens one (`gspo train --resume RUN`,
`gspo eval RUN`) must not run its author's code or send its author their credentials. The checks run on
the config before anything is imported or sent (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path

import yaml

from gspo.config import Config, ConfigError
from gspo.config.loading import RENAMED, code_file
from gspo.run.own_runs import file_digest, recorded_files


class UntrustedRunFolder(ConfigError):
    """A run folder's config names code or a server that the user has not named themselves."""


def code_rewards(config: Config) -> list[str]:
    """The configured rewards that are code to import ("file.py:function", "module:function")."""
    return [name for name in config.rewards if ":" in name]


def rewards_override(config: Config) -> str:
    """The override that names the config's rewards: "'rewards={/abs/r.py:fn: 1, digit_fraction: 0.5}'"."""
    weights = ", ".join(f"{name}: {weight:g}" for name, weight in config.rewards.items())
    return f"'rewards={{{weights}}}'"


def overridden_keys(overrides: Sequence[str]) -> set[str]:
    """The dotted keys the overrides set, under their current names."""
    keys = {override.partition("=")[0].strip() for override in overrides}
    return keys | {new for old, news in RENAMED.items() if old in keys for new in news}


def named_rewards(overrides: Sequence[str]) -> set[str]:
    """The reward names given in `rewards={...}` overrides, a reward file's path made absolute against the
    working directory as load_config does with an override's paths (config.rewards holds them so)."""
    names: set[str] = set()
    for override in overrides:
        key, _, raw = override.partition("=")
        if key.strip() == "rewards":
            with contextlib.suppress(yaml.YAMLError, RecursionError):
                value = yaml.safe_load(raw)
                names |= {_absolute(str(name)) for name in value} if isinstance(value, dict) else set()
    return names


def _absolute(name: str) -> str:
    file = code_file(name)
    if file is None:
        return name
    return f"{os.path.abspath(file.expanduser())}:{name.rpartition(':')[2]}"


def users_code_files(config: Config, overrides: Sequence[str], *, resumed: bool) -> list[Path]:
    """The code files the user named for a run they start: all that `config` names when it is theirs (a
    new run), else those the overrides name again (a resumed run's config.yaml is its folder's)."""
    keys = [_value(config, key) for key in CODE_KEYS]
    names = [*code_rewards(config), *keys]
    if resumed:
        given = overridden_keys(overrides)
        named = [_value(config, key) for key in CODE_KEYS if key in given]
        names = [*(set(code_rewards(config)) & named_rewards(overrides)), *named]
    return [file for name in names if (file := code_file(name)) is not None]


def _own_code(name: str, folder: Path) -> tuple[bool, str]:
    """Whether code `name` is a file the user started the run in `folder` with, unchanged since
    (gspo.run.own_runs); else what the refusal adds about the record."""
    file = code_file(name)
    if file is None:  # a module: only files are recorded
        return False, ""
    recorded, problem = recorded_files(folder)
    digest = recorded.get(str(file.resolve()))
    if digest is None:
        return False, f" ({problem})" if problem else ""
    if file.is_file() and file_digest(file.resolve()) == digest:
        return True, ""
    return False, f" ({file} has changed since you started this run with it)"


CODE_KEYS = {"train.objective": "the objective", "rollout.engine": "the sampler factory"}
"""The keys whose value may be code ("path/file.py:function", "module:function") besides the rewards."""


def _value(config: Config, key: str) -> str:
    section, _, name = key.partition(".")
    return getattr(getattr(config, section), name)


def check_code_keys(
    config: Config,
    overrides: Sequence[str],
    *,
    folder: Path,
    trust_run_code: bool = False,
    keys: Sequence[str] = tuple(CODE_KEYS),
) -> None:
    """Refuse a run folder's train.objective or rollout.engine that is code ("file.py:function",
    "module:function") unless the user names it (an override of the key), started this run with it, or
    `trust_run_code`."""
    for key in keys:
        name = _value(config, key)
        if ":" not in name or trust_run_code or key in overridden_keys(overrides):
            continue
        own, why = _own_code(name, folder)
        if own:
            continue
        raise UntrustedRunFolder(
            f"{folder / 'config.yaml'} names {CODE_KEYS[key]} {name!r}, Python code that gspo would import and "
            f"run: a run folder is data, so its code runs only when you name it yourself{why}. Read the code, "
            f"then pass {key}={name} on the command line, or --trust-run-code"
        )


def check_run_folder_config(
    config: Config,
    overrides: Sequence[str],
    *,
    folder: Path,
    trust_run_code: bool = False,
    server: bool = True,
) -> None:
    """Refuse what a run folder's config names that the user has not: reward, objective and sampler code (unless
    the overrides name it, the user started the run with it, or `trust_run_code`) and, with `server`, rollout.engine=openai's URL and key
    variable (unless set by the overrides)."""
    source = folder / "config.yaml"
    check_code_keys(config, overrides, folder=folder, trust_run_code=trust_run_code)
    mine = named_rewards(overrides)
    foreign = [name for name in code_rewards(config) if name not in mine]
    for name in [] if trust_run_code else foreign:
        own, why = _own_code(name, folder)
        if own:
            continue
        raise UntrustedRunFolder(
            f"{source} names the reward {name!r}, Python code that gspo would import and run: a run "
            f"folder is data, so its code runs only when you name it yourself{why}. Read the code, then pass "
            f"{rewards_override(config)} on the command line, or --trust-run-code"
        )
    openai = config.rollout.openai
    if not server or config.rollout.engine != "openai":
        return
    keys = overridden_keys(overrides)
    if "rollout.openai.url" not in keys:
        raise UntrustedRunFolder(
            f"{source} sends rollouts to rollout.openai.url={openai.url!r}: a run folder does not choose "
            f"where gspo connects; pass rollout.openai.url={openai.url} on the command line to confirm it"
        )
    default = type(openai)().api_key_env
    if openai.api_key_env != default and "rollout.openai.api_key_env" not in keys:
        raise UntrustedRunFolder(
            f"{source} names the environment variable {openai.api_key_env!r} as the API key: a run folder "
            f"does not choose which secret is sent; pass rollout.openai.api_key_env={openai.api_key_env} on "
            f"the command line to send it to {openai.url}"
        )
