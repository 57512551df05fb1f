"""Resuming a run: the config it continues with, checked against the one its checkpoint was trained with,
and the checkpoint's optimizer, scheduler, RNG and data-stream state put back.

Each checkpoint stores the resolved config it was written under (``config.yaml`` beside the weights). On
resume, the run folder's ``config.yaml`` plus the command line's overrides is compared with it key by key:
changes that only say how long to train or what to log are taken (``RESUMABLE``); any other change is
refused, naming each key, unless ``force`` (``gspo train --resume RUN --force``), which applies it for real
(an lr change reaches the optimizer and the schedule). The model, LoRA and task keys cannot change at all:
the checkpoint holds that model's weights and that data's position.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import yaml

from gspo.config import Config, ConfigError, ServeConfig, load_config, to_dict
from gspo.files import run_path
from gspo.learning.policy import Policy
from gspo.parallel.group import is_main
from gspo.parallel.state import load_optimizer_state, resume_rank_state
from gspo.run.checkpoint import CONFIG_FILE, latest_checkpoint, load_trainer_state, set_rng_state

RUN_MARKER = ".gspo_run"
"""Written into every run folder gspo creates: a folder without it (and without checkpoints) is not ours."""
RUN_FILES = (
    "config.yaml",
    "metrics.jsonl",
    "completions.jsonl",
    "summary.md",
    "tensorboard",
    "wandb",
    "trackers.json",
    "plots",
    "checkpoints",
)
"""What gspo writes into a run folder; a run stopped before its first checkpoint restarts without them."""


class RunFolderError(RuntimeError):
    """The run folder cannot be used: it holds another run, something that is not a gspo run, or
    nothing to resume."""


RESUMABLE = frozenset(
    {
        "output_dir",  # the folder resumed is the run's folder, wherever it was moved
        "train.steps",
        "train.warn_after_flat_steps",
        "eval.every",
        "eval.batch_size",
        "checkpoint.every",
        "checkpoint.keep",
        "checkpoint.optimizer",
        "report_to",
        "progress",
        "completions_per_step",
        "reward_timeout",
        "rollout.openai.timeout",
        "rollout.openai.concurrency",
        "rollout.llama_cpp.timeout",
        "distributed.timeout_minutes",
        *(f"serve.{f.name}" for f in dataclasses.fields(ServeConfig)),
    }
)
"""Keys a resumed run may change freely: how long to train, how often to evaluate and checkpoint, what to
show, timeouts, and how `gspo serve` listens and queues; none of them changes what an update computes.
(With train.schedule=cosine, a new train.steps stretches the rest of the schedule to the new end.)"""

FIXED = ("model.", "lora.", "task.")
"""Prefixes of keys no resume may change, even with force: the checkpoint holds that model's (or adapter's)
weights and that task's data position."""


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out |= _flatten(item, f"{prefix}{key}.")
        return out or {prefix[:-1]: {}}
    return {prefix[:-1]: value}


class _Absent:
    """A key one of two configs does not have (a reward, a dataset setting): shown as such in a refusal."""

    def __repr__(self) -> str:
        return "(absent)"


def config_changes(saved: Config, requested: Config) -> list[tuple[str, Any, Any]]:
    """(dotted key, saved value, requested value) for every key whose value differs, in key order; a key
    that only one of them has is `_Absent` in the other."""
    a, b = _flatten(to_dict(saved)), _flatten(to_dict(requested))
    missing = _Absent()
    return [
        (key, a.get(key, missing), b.get(key, missing))
        for key in sorted(set(a) | set(b))
        if a.get(key, missing) != b.get(key, missing)
    ]


def check_resume_config(checkpoint: Path, requested: Config, *, force: bool) -> None:
    """Refuse a resume whose config changes more than `RESUMABLE` keys (any `FIXED` key even with force),
    or whose checkpoint has no config of its own to compare with (unless force)."""
    path = checkpoint / CONFIG_FILE
    if not path.is_file():
        if force:
            return
        raise ConfigError(
            f"{checkpoint} has no {CONFIG_FILE} of its own, so gspo cannot tell whether the resumed run would "
            f"compute what it was trained to: pass --force to resume it with "
            f"{checkpoint.parent.parent / 'config.yaml'} as it is"
        )
    try:
        saved = load_config(path)
    except ConfigError as error:
        raise ConfigError(f"the checkpoint's own config cannot be read: {error}") from None
    changes = [c for c in config_changes(saved, requested) if c[0] not in RESUMABLE]
    fixed = [c for c in changes if c[0].startswith(FIXED)]
    shown = "; ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in (fixed or changes)[:12])
    more = f" (and {len(changes) - 12} more)" if len(changes) > 12 else ""
    if fixed:
        raise ConfigError(
            f"resuming {checkpoint} with {shown}: model, lora and task keys cannot change on resume, even "
            "with --force (the checkpoint holds that model's weights and that task's data position); "
            f"undo the change, or start a new run from its weights (model.path={checkpoint / 'model'})"
        )
    if changes and not force:
        raise ConfigError(
            f"resuming would change what the run computes, from the config its checkpoint was trained "
            f"with: {shown}{more}. Undo these changes (in {checkpoint.parent.parent / 'config.yaml'} or the "
            "overrides), or pass --force to apply them to the resumed run"
        )


def nothing_to_resume(run_dir: Path) -> str:
    """Why `run_dir`, without a checkpoint or gspo's marker, cannot be resumed: it is not there at all, or it
    holds no gspo run."""
    if not run_dir.exists():
        return (
            f"{run_dir} does not exist: --resume takes the folder of a run (its output_dir); check the path, or "
            "start a new run there"
        )
    return f"{run_dir} holds no gspo run to resume (no checkpoint in {run_dir / 'checkpoints'}): start a new run instead"


def resume_config(
    run_dir: str | Path, overrides: list[str] | tuple[str, ...] = (), *, force: bool = False
) -> Config:
    """The config a resumed run asks for: the run folder's config.yaml (or, if it is gone, the latest
    checkpoint's) plus the overrides; `check_resume_config` then compares it with the checkpoint's. An
    emptied config.yaml (every key its default) is refused unless `force`."""
    run_dir = Path(run_dir)
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None and not (run_dir / RUN_MARKER).is_file():
        raise RunFolderError(nothing_to_resume(run_dir))
    path = run_path(run_dir, "config.yaml")
    if not path.is_file() and checkpoint is not None and (checkpoint / CONFIG_FILE).is_file():
        path = checkpoint / CONFIG_FILE
    if path.is_file() and not force and _empty_yaml(path):
        saved = "" if checkpoint is None else f" (the checkpoint's own is {checkpoint / CONFIG_FILE})"
        raise ConfigError(
            f"{path} is empty: resuming would take every key's default; restore it{saved}, or pass --force "
            "to resume with the defaults"
        )
    return load_config(path, overrides)


def _empty_yaml(path: Path) -> bool:
    """Whitespace, comments or an empty mapping: nothing set (an unreadable file: load_config says why)."""
    try:
        return not yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError):
        return False


def restore_state(checkpoint: Path, policy: Policy, config: Config) -> tuple[int, dict[str, Any]]:
    """Put back a checkpoint's optimizer, scheduler and (this rank's) random streams; returns its step and
    the rest of its state, this rank's data position as "stream" (`gspo train`) and the server's "serve".

    The optimizer hyperparameters and the schedule's base rate are then set from ``config``: unchanged,
    this recomputes the very same values; changed by a forced resume, the change takes effect.
    """
    state = load_trainer_state(checkpoint)
    if "optimizer" in state:
        load_optimizer_state(policy.model, policy.optimizer, state["optimizer"])
    elif is_main():
        print(
            f"note: {checkpoint} holds no optimizer state (checkpoint.optimizer=false): AdamW's moments start "
            "from zero, so the run continues close to, not exactly as, an uninterrupted run",
            file=sys.stderr,
        )
    policy.scheduler.load_state_dict(state["scheduler"])
    # an adapted coefficient continues where it was; a fixed one is the config's (a forced resume may change it)
    if "entropy" in state and policy.entropy.target is not None:
        policy.entropy.load_state_dict(state["entropy"])
    mine = resume_rank_state(state)  # this rank's RNG streams and data position
    set_rng_state(mine["rng"])
    apply_optimizer_settings(policy, config)
    skip = {"optimizer", "scheduler", "entropy", "rng", "ranks", "step"}
    return int(state["step"]), {k: v for k, v in state.items() if k not in skip} | mine


def apply_optimizer_settings(policy: Policy, config: Config) -> None:
    """lr, betas and weight decay from the config into every param group, and the current lr recomputed
    from the schedule: ``lr = train.lr * factor(updates so far)``, as LambdaLR computes it."""
    train, scheduler = config.train, policy.scheduler
    scheduler.base_lrs = [train.lr for _ in policy.optimizer.param_groups]
    for group, factor in zip(policy.optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group.update(
            initial_lr=train.lr,
            lr=train.lr * factor(scheduler.last_epoch),
            betas=tuple(train.adam_betas),
            weight_decay=train.weight_decay,
        )
    scheduler._last_lr = [group["lr"] for group in policy.optimizer.param_groups]
