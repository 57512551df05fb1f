"""A run folder is data: its config.yaml may name reward code, servers and paths outside the folder, but
gspo runs that code, connects to those servers and reads or writes those paths only when the user names
them on the command line, passes --trust-run-folder, or started that run, in that folder, with those very
files and values (gspo.run.own_runs).

People share run folders the way they share checkpoints; whoever opens one (`gspo train --resume RUN`,
`gspo eval RUN`, `gspo export RUN`, `gspo serve --resume RUN`) must not run its author's code, send its
author their prompts, weights or credentials, or read and write where its author chose. The checks run on
the config before anything is imported, sent, read or written (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

from gspo.config import Config, ConfigError
from gspo.config.engines import engine_of
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


def continue_command(
    config: Config, run_dir: Path, *, python_rewards: Sequence[str] = (), name_code: bool = False
) -> str:
    """How a stopped run continues: `gspo train --resume RUN` (with ``name_code``, naming its reward code
    again: the user is editing it, and an edited file is no longer the one the run started with); or, when
    its rewards were Python functions given to train() or Trainer, the Python call that gives them again (a
    command line cannot name a function of a script: their names in config.yaml are no built-ins)."""
    if python_rewards:
        return f"train(resume={str(run_dir)!r}, reward_functions=[{', '.join(python_rewards)}])"
    command = f"gspo train --resume {run_dir}"
    if name_code and code_rewards(config):
        command += f" {rewards_override(config)}"
    return command


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

REACHES = {
    "rollout.openai.url": "the server gspo sends its prompts (and the API key) to",
    "rollout.openai.api_key_env": "the environment variable whose secret gspo sends to that server as the API key",
    "rollout.vllm.url": "the vLLM server gspo sends its prompts and the policy's weights to",
    "rollout.vllm.weights_dir": "the folder gspo writes the policy's weights into",
    "rollout.vllm.server_weights_dir": "the folder gspo tells the vLLM server to load weights from",
    "rollout.vllm.nccl_address": "the address gspo opens its NCCL group on for the server's workers",
    "task.data_path": "the data gspo reads, and copies into its evaluation reports",
    "task.eval_data_path": "the held-out data gspo reads, and copies into its evaluation reports",
    "judge.url": "the LLM judge gspo sends the completions (and the API key) to",
    "judge.api_key_env": "the environment variable whose secret gspo sends to the judge as the API key",
    "judge.template": "the prompt template gspo reads and sends to the judge",
    "reward_model.path": "the reward model gspo loads and runs",
    "model.path": "the model gspo loads (a LoRA run's base weights, or the GGUF whose metadata it copies)",
}
"""The keys whose value reaches outside the run folder: a server gspo connects to, a path it reads or writes.
A run folder's value is used only when the user names it (module docstring); docs/reliability.md's table."""


LOCAL_PATHS = (
    "rollout.vllm.weights_dir",
    "task.data_path",
    "task.eval_data_path",
    "model.path",
    "judge.template",
    "reward_model.path",
)
"""The `REACHES` keys that are paths on this machine: one inside the run folder is the folder's own (the
rows a run was given as `data=`, kept in RUN/data.jsonl), not a place outside it."""


def _inside(path: str, folder: Path) -> bool:
    """Whether `path`, its links followed, lies in `folder` (a `../` or a link out of it does not)."""
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder))


def _value(config: Config, key: str) -> Any:
    return functools.reduce(getattr, key.split("."), config)


def model_reaches(config: Config, *, copies_gguf: bool) -> list[str]:
    """["model.path"] when gspo reads the file it names beside a checkpoint: a LoRA run's base weights, or
    (``copies_gguf``: an export or llama_cpp's engine) the GGUF whose metadata and tokenizer it copies."""
    model = config.model
    if model.tiny is not None or model.path is None:
        return []
    gguf = copies_gguf and model.path.endswith(".gguf")
    return ["model.path"] if config.lora.rank > 0 or gguf else []


def used_reaches(config: Config) -> list[str]:
    """The `REACHES` keys `config` makes `gspo train` use: its engine's server and weights folders, a data
    file, the model file it reads beside a checkpoint (`model_reaches`)."""
    engine = engine_of(config)  # a user's own sampler factory reaches what its code does: trusted as code
    used = engine.reaches(config) if engine is not None else []
    if config.task.name == "file" and config.task.data_path is not None:
        used.append("task.data_path")
    if config.task.eval_data_path is not None:
        used.append("task.eval_data_path")
    if "judge" in config.rewards:
        used += ["judge.url", "judge.template"]
        if config.judge.api_key_env != type(config.judge)().api_key_env:
            used.append("judge.api_key_env")
    if "reward_model" in config.rewards:
        used.append("reward_model.path")
    return used + model_reaches(config, copies_gguf=engine is not None and engine.copies_gguf)


def check_reaches(
    config: Config,
    overrides: Sequence[str],
    *,
    folder: Path,
    trust_run_folder: bool = False,
    keys: Iterable[str],
) -> None:
    """Refuse each of `keys` (`REACHES`) whose value comes from the run folder's config: unless the
    overrides name it, it is a path inside the folder (`LOCAL_PATHS`), the user started this run with that
    value (gspo.run.own_runs), or `trust_run_folder`."""
    given = overridden_keys(overrides)
    refused: list[tuple[str, Any, str]] = []  # every one at once: a user confirms them in one command
    for key in [] if trust_run_folder else keys:
        value = _value(config, key)
        if key in given or (key in LOCAL_PATHS and _inside(str(value), folder)):
            continue
        recorded, problem = recorded_files(folder)
        if key in recorded and recorded[key] == str(value):
            continue
        why = f" ({problem})" if problem else ""
        if key in recorded:
            why = f" (you started this run with {key}={recorded[key]})"
        refused.append((key, value, why))
    if not refused:
        return
    named = "; ".join(f"{key}={str(value)!r}, {REACHES[key]}" for key, value, _ in refused)
    whys = "".join(dict.fromkeys(why for _, _, why in refused))
    confirm = " ".join(f"{key}={value}" for key, value, _ in refused)
    them = "it" if len(refused) == 1 else "them"
    raise UntrustedRunFolder(
        f"{folder / 'config.yaml'} names {named}: a run folder does not choose where gspo connects, nor what "
        f"it reads or writes outside the folder{whys}; pass {confirm} on the command line to confirm {them}, "
        "or --trust-run-folder"
    )


def users_reaches(config: Config, overrides: Sequence[str], *, resumed: bool) -> dict[str, str]:
    """The `REACHES` values the user named for a run they start, to record as theirs (gspo.run.own_runs):
    all that `config` uses when it is theirs (a new run), else those the overrides name again."""
    used = used_reaches(config)
    if resumed:
        given = overridden_keys(overrides)
        used = [key for key in used if key in given]
    return {key: str(_value(config, key)) for key in used}


def check_code_keys(
    config: Config,
    overrides: Sequence[str],
    *,
    folder: Path,
    trust_run_folder: bool = False,
    keys: Sequence[str] = tuple(CODE_KEYS),
) -> None:
    """Refuse a run folder's train.objective or rollout.engine that is code ("file.py:function",
    "module:function") unless the user names it (an override of the key), started this run with it, or
    `trust_run_folder`."""
    for key in keys:
        name = _value(config, key)
        if ":" not in name or trust_run_folder or key in overridden_keys(overrides):
            continue
        own, why = _own_code(name, folder)
        if own:
            continue
        raise UntrustedRunFolder(
            f"{folder / 'config.yaml'} names {CODE_KEYS[key]} {name!r}, Python code that gspo would import and "
            f"run: a run folder is data, so its code runs only when you name it yourself{why}. Read the code, "
            f"then pass {key}={name} on the command line, or --trust-run-folder"
        )


def check_run_folder_config(
    config: Config,
    overrides: Sequence[str],
    *,
    folder: Path,
    trust_run_folder: bool = False,
    reaches: Iterable[str] | None = None,
    rewards_replaced: bool = False,
) -> None:
    """Refuse what a run folder's config names that the user has not: reward, objective and sampler code,
    and the servers and paths outside the folder it makes gspo use (`reaches`: those of `REACHES` the command
    uses; None: every one `used_reaches` finds). Each passes when the overrides name it, the user started
    the run with it (gspo.run.own_runs), or with `trust_run_folder`; the rewards pass too when
    `rewards_replaced` (Python callables replace them: nothing of theirs is imported)."""
    source = folder / "config.yaml"
    refusals: list[str] = []  # every confirmation the folder needs, said at once

    def refusal(check: Callable[[], None]) -> None:
        try:
            check()
        except UntrustedRunFolder as error:
            refusals.append(str(error))

    refusal(lambda: check_code_keys(config, overrides, folder=folder, trust_run_folder=trust_run_folder))
    mine = named_rewards(overrides)
    foreign = [name for name in code_rewards(config) if name not in mine]
    for name in [] if trust_run_folder or rewards_replaced else foreign:
        own, why = _own_code(name, folder)
        if own:
            continue
        refusals.append(
            f"{source} names the reward {name!r}, Python code that gspo would import and run: a run "
            f"folder is data, so its code runs only when you name it yourself{why}. Read the code, then pass "
            f"{rewards_override(config)} on the command line, or --trust-run-folder"
        )
        break  # one override names every reward
    used = used_reaches(config)
    keys = used if reaches is None else [key for key in used if key in set(reaches)]
    refusal(
        lambda: check_reaches(config, overrides, folder=folder, trust_run_folder=trust_run_folder, keys=keys)
    )
    if refusals:
        raise UntrustedRunFolder(" Also: ".join(refusals))
