"""GRPOTrainer: TRL's trainer over gspo's `train` (gspo.trl's docstring): its arguments checked at
construction, `train()` a new run or a resumed one, and what TRL's trainer holds (state, model,
callbacks) from the run folder."""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState
from transformers.trainer_utils import TrainOutput

from gspo.config import Config, ConfigError, load_config
from gspo.config.rules import value_of
from gspo.config.trl import as_code
from gspo.config.values import shown
from gspo.models.loading import hub_snapshot, load_model, save_model
from gspo.parallel.group import launched_world_size, resolve_device
from gspo.rewards.resolve import CONFIGURED, resolve_reward
from gspo.run import lock
from gspo.run.build import load_checkpoint_policy
from gspo.run.checkpoint import CONFIG_FILE, checkpoint_step, is_complete, latest_checkpoint
from gspo.run.folder import setup_run_dir, start_fresh
from gspo.run.metrics import read_metrics
from gspo.run.resume import RESUMABLE, resume_config
from gspo.training.launch import train as gspo_train
from gspo.trl.grpo_config import GRPOConfig
from gspo.trl.rewards import RewardFunc, named_reward, split_reward_funcs, trl_call

IGNORED_COLUMNS = ("completion", "completion_ids")
"""Columns TRL does not pass to reward functions (a prompt-completion dataset's reference completion)."""

EVENTS = ("on_init_end", "on_train_begin", "on_step_end", "on_log", "on_evaluate", "on_train_end")
"""The TrainerCallback methods GRPOTrainer calls (gspo.trl's docstring)."""


class GRPOTrainer:
    """TRL's GRPOTrainer's signature over gspo's `train` (gspo.trl's docstring). Settings are checked here,
    at construction; `train()` runs."""

    def __init__(
        self,
        model: Any,
        reward_funcs: RewardFunc | str | list[RewardFunc | str] | None = None,
        args: GRPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: Any = None,
        optimizers: tuple[Any, Any] = (None, None),
        peft_config: Any = None,
        tools: Any = None,
        **others: Any,
    ) -> None:
        _refuse(
            {
                "reward_processing_classes": reward_processing_classes,
                "optimizers": None if optimizers == (None, None) else optimizers,
                "tools": tools,
                **others,
            }
        )
        self.args = _checked_args(args)
        rows = _rows(train_dataset, "train_dataset")
        columns = _columns(train_dataset, "train_dataset")
        _check_eval_dataset(eval_dataset, columns)
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self._model_object = None if isinstance(model, (str, Path)) else model
        self.processing_class = _processing_class(model, processing_class)
        functions, reward_model = split_reward_funcs(reward_funcs)
        self._reward_names = [*functions, *(["reward_model"] if reward_model else [])]
        self._given: dict[str, Any] = {  # what the arguments say, among gspo's keys
            "model.path": None if self._model_object is not None else str(model),  # an object: at train()
            "model.tiny": None,
            "task.answer_fields": [c for c in columns if c not in IGNORED_COLUMNS],
            **({"reward_model.path": reward_model} if reward_model else {}),
            **{f"lora.{key}": value for key, value in _lora(peft_config).items()},
        }
        self.config = self.args.gspo_config(
            rows=rows, reward_names=self._reward_names, holds_out=eval_dataset is None, given=self._given
        )
        if reward_model and self.config.reward_model.path != reward_model:
            raise ConfigError(
                f"reward_funcs names the reward model {reward_model!r}, and gspo={{'reward_model': {{'path': "
                f"{self.config.reward_model.path!r}}}}} another: a run has one reward model, keep one"
            )
        self._updates = self.config.train.minibatches  # TRL's optimizer updates per gspo step
        conversational = _conversational(train_dataset)
        self.reward_funcs = [trl_call(f, conversational, self._updates) for f in functions.values()]
        self._rewards = dict(zip(functions, self.reward_funcs, strict=True))
        for name in self.config.rewards:  # gspo's named rewards: resolved now, the configured ones at train()
            if name not in self._rewards and name not in CONFIGURED:
                self._rewards[name] = named_reward(name, self.config)
        self.callbacks = _callbacks(callbacks)
        self.control = TrainerControl()
        self.run_dir: Path | None = None
        self._live: TrainerState | None = None
        self._loaded: tuple[Any, Any] | None = None
        self._call("on_init_end", self._fresh_state())

    # ---- training -------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: bool | str | None = None, **others: Any) -> TrainOutput:
        """Train, as TRL's trainer.train(). ``resume_from_checkpoint``: True continues output_dir's run from
        its latest checkpoint; a path OUTPUT_DIR/checkpoint-N (TRL's form, N optimizer updates) or
        OUTPUT_DIR/checkpoints/step_NNNNNN (gspo's) continues that run from that checkpoint, with this
        GRPOConfig's run length, checkpoints, evaluations and logging (a note says what changed). Returns
        transformers' TrainOutput: the optimizer updates done, the mean loss of this call's steps, and
        gspo's result (the run folder, the first and last eval accuracy, the summary) with train_runtime."""
        _refuse(others, where="train")
        point = self._resume_point(resume_from_checkpoint)
        rewards = {name: self._rewards.get(name) or self._configured(name) for name in self.config.rewards}
        lines: list[tuple[int, str, dict[str, float]]] = []
        hooks = [self._logged, lambda *line: lines.append(line)]
        started = time.perf_counter()
        try:
            if point is None:
                config = self._new_run_config()
                self._live = self._fresh_state()
                self._call("on_train_begin", self._live)
                result = gspo_train(
                    config,
                    reward_functions=rewards,
                    data=self.train_dataset,
                    eval_data=self.eval_dataset,
                    on_log=hooks,
                )
            else:
                run, step = point
                overrides = self._resume_overrides(run)
                done = step if step is not None else _latest_step(run)
                self._live = _state_of(run, self._updates, self._max_steps(), upto=done)
                self._call("on_train_begin", self._live)
                result = gspo_train(
                    resume=run, overrides=overrides, reward_functions=rewards, from_step=step, on_log=hooks
                )
        finally:
            live, self._live = self._live, None
        self.run_dir, self._loaded = Path(result["run_dir"]), None
        self._call("on_train_end", live or self.state)
        losses = [m["loss"] for _, kind, m in lines if kind == "train" and m.get("loss") is not None]
        loss = sum(losses) / len(losses) if losses else 0.0
        metrics = {**result, "train_runtime": time.perf_counter() - started}
        return TrainOutput(self.state.global_step, loss, metrics)

    def _configured(self, name: str) -> Any:
        """The reward model or judge of the config's sections, built on the run's device."""
        return resolve_reward(name, self.config, device=resolve_device(self.config.device))

    def _new_run_config(self) -> Config:
        """The config of a new run; a model object saved into it first (output_dir/base_model/)."""
        if self._model_object is None:
            return self.config
        if launched_world_size() > 1:
            raise ConfigError(
                "GRPOTrainer(model=<a model object>) under torchrun: every rank would save it; save it once "
                "(model.save_pretrained(DIR), its tokenizer too) and pass model=DIR"
            )
        run_dir, _ = setup_run_dir(self.config, None)  # refused as gspo refuses it: a folder not its own
        start_fresh(run_dir)  # created, locked and marked as a gspo run: its base_model is the run's
        base = Path(os.path.abspath(run_dir / "base_model"))
        try:
            save_model(self._model_object, self.processing_class, base)
        except BaseException:
            lock.release(run_dir)
            raise
        print(f"note: model= is an object: saved into {base}, which the run trains from", file=sys.stderr)
        model = dataclasses.replace(self.config.model, path=str(base), tiny=None)
        return dataclasses.replace(self.config, output_dir=str(run_dir), model=model)

    def _resume_point(self, value: Any) -> tuple[Path, int | None] | None:
        """The run folder to continue and its step (None: the latest checkpoint), or None: a new run."""
        if value is None or value is False:
            return None
        forms = (
            "give True (the latest checkpoint of output_dir), TRL's OUTPUT_DIR/checkpoint-N (after N optimizer "
            "updates) or gspo's OUTPUT_DIR/checkpoints/step_NNNNNN"
        )
        if value is True:
            if self.config.output_dir is None:
                raise ConfigError(
                    "train(resume_from_checkpoint=True) continues the run in GRPOConfig's output_dir, which is "
                    "None: set output_dir=the run's folder"
                )
            return Path(self.config.output_dir), None
        if not isinstance(value, (str, os.PathLike)):
            raise ConfigError(f"train(resume_from_checkpoint={shown(value)}): {forms}")
        path = Path(value)
        if trl := re.fullmatch(r"checkpoint-(\d+)", path.name):
            done = int(trl[1])
            if done % self._updates:
                raise ConfigError(
                    f"train(resume_from_checkpoint={str(value)!r}): gspo checkpoints after a rollout batch of "
                    f"{self._updates} optimizer updates, so N in checkpoint-N is a multiple of {self._updates}"
                )
            return path.parent, self._checked_step(path.parent, done // self._updates, value)
        if (own := re.fullmatch(r"step_(\d+)", path.name)) and path.parent.name == "checkpoints":
            return path.parent.parent, self._checked_step(path.parent.parent, int(own[1]), value)
        raise ConfigError(f"train(resume_from_checkpoint={str(value)!r}): {forms}")

    def _checked_step(self, run: Path, step: int, value: Any) -> int:
        folder = run / "checkpoints" / f"step_{step:06d}"
        if folder.is_dir() and is_complete(folder):
            return step
        steps = _complete_steps(run)
        held = ", ".join(f"checkpoint-{s * self._updates}" for s in steps) or "none"
        raise ConfigError(
            f"train(resume_from_checkpoint={str(value)!r}): {run} holds no complete checkpoint of gspo's step "
            f"{step} (its checkpoints: {held}; save_total_limit sets how many a run keeps)"
        )

    def _resume_overrides(self, run: Path) -> list[str]:
        """The keys this GRPOConfig sets that differ from the run's config.yaml, as `key=value` overrides:
        those a resume may change (gspo.run.resume.RESUMABLE), said on stderr; any other is refused, by
        the GRPOConfig setting that changed it."""
        saved = resume_config(run)
        keys, origin = self.args.settings(
            rows=_rows(self.train_dataset, "train_dataset"),
            reward_names=self._reward_names,
            holds_out=self.eval_dataset is None,
            given=self._given,
        )
        for key in _flat(self.args.gspo):
            origin.setdefault(key, "gspo")
        changed, refused = {}, []
        for key in sorted(set(keys) | set(_flat(self.args.gspo))):
            if key == "output_dir" or key.startswith("model.") or not _has(saved, key):
                continue
            old, new = value_of(saved, key), value_of(self.config, key)
            if old == new:
                continue
            if key in RESUMABLE:
                changed[key] = new
            else:
                refused.append(f"{origin[key]} ({key}: {shown(old)} -> {shown(new)})")
        if refused:
            raise ConfigError(
                f"train(resume_from_checkpoint=...): this GRPOConfig changes {'; '.join(refused)}, which {run} "
                "was trained with; a resume may change the run's length, checkpoints, evaluations and logging "
                "alone: set the others back, or start a new run in another output_dir"
            )
        if changed:
            said = ", ".join(
                f"{key} {shown(value_of(saved, key))} -> {shown(v)}" for key, v in changed.items()
            )
            print(f"note: resuming {run} with {said}", file=sys.stderr)
        return shlex.split(as_code(changed, python=False))

    # ---- what TRL's trainer holds ---------------------------------------------------------------------
    @property
    def state(self) -> TrainerState:
        """transformers' TrainerState of the run: global_step (optimizer updates), max_steps and
        log_history, read from the run's metrics.jsonl (during train(): as its lines are logged)."""
        if self._live is not None:
            return self._live
        if self.run_dir is None:
            return self._fresh_state()
        return _state_of(self.run_dir, self._updates, self._max_steps())

    @property
    def model(self) -> Any:
        """The model: after train(), the run's latest checkpoint (LoRA merged), loaded on first access;
        before, the model given (loaded from its path on first access)."""
        if self._loaded is None:
            checkpoint = latest_checkpoint(self.run_dir) if self.run_dir is not None else None
            if checkpoint is not None:
                own = checkpoint / CONFIG_FILE  # the model and LoRA settings it was trained with
                config = load_config(own if own.is_file() else self.run_dir / "config.yaml")  # type: ignore[operator]
                self._loaded = load_checkpoint_policy(config, checkpoint)
            elif self._model_object is not None:
                self._loaded = (self._model_object, self.processing_class)
            else:
                self._loaded = load_model(self.config.model, seed=self.config.seed)
        return self._loaded[0]

    def save_model(self, output_dir: str | None = None) -> Path:
        """The trained weights as a Hugging Face folder (LoRA merged): `output_dir`, or RUN/export/ when it
        is None or the run folder itself (gspo's run folder holds checkpoints, not a model); returns it."""
        from gspo.training.export import export_run

        if self.run_dir is None:
            raise RuntimeError("save_model() comes after train(): there is no trained model yet")
        inside = output_dir is None or Path(output_dir).resolve() == self.run_dir.resolve()
        return export_run(self.run_dir, format="hf", output=None if inside else output_dir)

    # ---- callbacks --------------------------------------------------------------------------------------
    def _max_steps(self) -> int:
        return self.config.train.steps * self._updates

    def _fresh_state(self) -> TrainerState:
        return TrainerState(max_steps=self._max_steps())

    def _logged(self, step: int, kind: str, metrics: dict[str, float]) -> None:
        """gspo's on_log: the line in the live state's log_history, then the callbacks (gspo.trl's docstring)."""
        state = self._live
        if state is None:  # only train() runs gspo's train, which calls it
            return
        entry = _history_entry(step, kind, metrics, self._updates)
        state.log_history.append(entry)
        logs = {k: v for k, v in entry.items() if k != "step"}
        if kind == "train":
            state.global_step = entry["step"]
            self._call("on_step_end", state)
        self._call("on_log", state, logs=logs)
        if kind == "eval":
            self._call("on_evaluate", state, metrics=logs)

    def _call(self, event: str, state: TrainerState, **kwargs: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, event)(self.args, state, self.control, **kwargs)


def _history_entry(step: int, kind: str, metrics: Mapping[str, Any], updates: int) -> dict[str, Any]:
    """A metrics line as transformers' log_history holds it: TRL's step (optimizer updates), an eval's
    metrics prefixed "eval_", each value as metrics.jsonl holds it."""
    prefix = "eval_" if kind == "eval" else ""
    return {**{f"{prefix}{k}": _number(v) for k, v in metrics.items()}, "step": step * updates}


def _number(value: Any) -> Any:
    """A metric as metrics.jsonl writes it: a Python number, None where it is not finite."""
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value) if math.isfinite(value) else None
    return value


def _state_of(run: Path, updates: int, max_steps: int, *, upto: int | None = None) -> TrainerState:
    """The TrainerState of a run folder's metrics.jsonl (its lines of steps up to `upto`)."""
    state = TrainerState(max_steps=max_steps)
    for line in read_metrics(run):
        step, kind = line["step"], line["kind"]
        if upto is not None and step > upto:
            continue
        metrics = {k: v for k, v in line.items() if k not in ("step", "kind")}
        state.log_history.append(_history_entry(step, kind, metrics, updates))
        if kind == "train":
            state.global_step = max(state.global_step, step * updates)
    return state


def _latest_step(run: Path) -> int:
    checkpoint = latest_checkpoint(run)
    return checkpoint_step(checkpoint) if checkpoint is not None else 0


def _complete_steps(run: Path) -> list[int]:
    root = run / "checkpoints"
    found = root.iterdir() if root.is_dir() else []
    return sorted(
        checkpoint_step(p)
        for p in found
        if re.fullmatch(r"step_\d+", p.name) and p.is_dir() and is_complete(p)
    )


def _flat(values: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys of gspo's nested keyword arguments (a section's leaves)."""
    out = []
    for key, value in values.items():
        if isinstance(value, Mapping) and f"{prefix}{key}" != "rewards" and value:
            out += _flat(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}")
    return out


def _has(config: Config, key: str) -> bool:
    try:
        value_of(config, key)
    except AttributeError:
        return False
    return True


# ---- GRPOTrainer's arguments ----------------------------------------------------------------------------
REFUSED_ARGUMENTS = {
    "reward_processing_classes": "gspo scores with the reward model's own tokenizer, saved in its folder: "
    "leave it out",
    "optimizers": "gspo trains with AdamW and GRPOConfig's learning_rate, lr_scheduler_type: leave it out",
    "tools": "gspo trains tool-using agents through `gspo serve` and your agent's own loop (docs/agents.md): "
    "leave it out",
}
"""GRPOTrainer's arguments gspo takes only unset, and what to do instead."""


def _refuse(given: dict[str, Any], where: str = "GRPOTrainer") -> None:
    """One line for the first argument given that gspo has no use for (`REFUSED_ARGUMENTS`, or any other
    of TRL's: rollout_func, environment_factory, train's trial, ...)."""
    for name, value in given.items():
        if value is not None and value != []:
            instead = REFUSED_ARGUMENTS.get(name, "gspo has no such argument: leave it out")
            raise ConfigError(f"{where}({name}=...): {instead}")


def _checked_args(args: Any) -> GRPOConfig:
    if args is None:
        return GRPOConfig()
    if isinstance(args, GRPOConfig):
        return args
    if type(args).__module__.startswith("trl"):
        raise ConfigError(
            f"GRPOTrainer(args=<{type(args).__module__}.{type(args).__name__}>): TRL's own config; import "
            "gspo's as well: from gspo.trl import GRPOConfig, GRPOTrainer"
        )
    if isinstance(args, Mapping):
        fix = f"args=GRPOConfig(**{shown(dict(args), 200)})"
    elif isinstance(args, (str, Path)):
        fix = f"args=GRPOConfig(output_dir={str(args)!r})"
    else:
        fix = "args=GRPOConfig(output_dir='runs/grpo')"
    raise ConfigError(f"GRPOTrainer(args={shown(args)}): args is a GRPOConfig (from gspo.trl): {fix}")


def _rows(dataset: Any, name: str) -> int:
    """The dataset's number of rows; a dataset without one (an IterableDataset) or without rows is refused."""
    if dataset is None:
        raise ConfigError(f"GRPOTrainer needs {name}: a datasets.Dataset with a 'prompt' column")
    try:
        rows = len(dataset)
    except TypeError:
        raise ConfigError(
            f"{name} is a {type(dataset).__name__} without a length: gspo draws its rollout batches "
            "from rows it holds, a datasets.Dataset (dataset = Dataset.from_list(list(iterable)))"
        ) from None
    if rows == 0:
        raise ConfigError(
            f"{name} has no rows: give at least one, e.g. Dataset.from_list([{{'prompt': '...'}}])"
        )
    return rows


def _columns(dataset: Any, name: str) -> list[str]:
    """The dataset's columns, the prompt among them (TRL's name for it)."""
    names = getattr(dataset, "column_names", None)
    if isinstance(names, Mapping):  # a DatasetDict: its splits' columns
        raise ConfigError(
            f"{name} is a {type(dataset).__name__} of splits {list(names)}: give one split, e.g. "
            f"{name}=dataset[{next(iter(names))!r}]"
        )
    if names is None and isinstance(dataset, Sequence) and dataset and isinstance(dataset[0], Mapping):
        names = list(dataset[0])
    if names is None:
        raise ConfigError(
            f"{name} is a {type(dataset).__name__}: give a datasets.Dataset (or a list of dicts) with a "
            "'prompt' column"
        )
    if "prompt" not in names:
        raise ConfigError(f"{name} has no 'prompt' column (its columns: {list(names)}): TRL's name for it")
    return list(names)


def _conversational(dataset: Any) -> bool:
    """TRL's test: the first row's prompt is a list of messages."""
    first = dataset[0]["prompt"]
    return isinstance(first, list) and bool(first) and isinstance(first[0], Mapping) and "role" in first[0]


def _processing_class(model: Any, processing_class: Any) -> Any:
    """The tokenizer a model object is saved with (processing_class, else its name_or_path's from the
    local cache), or None for a model gspo loads itself, whose own tokenizer processing_class may only be."""
    if isinstance(model, (str, Path)):
        given = getattr(processing_class, "name_or_path", None)
        if processing_class is not None and not _same_model(str(given), str(model)):
            raise ConfigError(
                f"GRPOTrainer(processing_class=<tokenizer of {given!r}>) for model={str(model)!r}: gspo trains with "
                "the model's own tokenizer, which it loads with the model; leave processing_class out"
            )
        return None
    if hasattr(model, "peft_config"):
        raise ConfigError(
            f"GRPOTrainer(model=<{type(model).__name__}>) is a peft model: pass its base model and the "
            "LoraConfig as peft_config= (gspo adds the adapters)"
        )
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "save_pretrained"):
        raise ConfigError(
            f"GRPOTrainer(model={shown(model)}): give a hub id in your Hugging Face cache, a model folder, or a "
            "transformers model (AutoModelForCausalLM.from_pretrained(...))"
        )
    if processing_class is not None:
        return processing_class
    name = getattr(model.config, "name_or_path", "") or ""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError):
        raise ConfigError(
            f"GRPOTrainer(model=<{type(model).__name__}>): gspo saves a model object with its tokenizer, and "
            f"finds none for its name_or_path {name!r}: give it, processing_class=AutoTokenizer.from_pretrained(...)"
        ) from None


def _same_model(a: str, b: str) -> bool:
    """Two names of one model: equal, or the same folder (a hub id: its snapshot in the local cache)."""
    if a == b:
        return True
    where = [Path(x).resolve() if Path(x).exists() else hub_snapshot(x) for x in (a, b)]
    return where[0] is not None and where[0] == where[1]


def _callbacks(callbacks: Any) -> list[TrainerCallback]:
    """transformers TrainerCallbacks (instances, or classes TRL instantiates), checked."""
    out = []
    for index, callback in enumerate(callbacks or []):
        if isinstance(callback, type) and issubclass(callback, TrainerCallback):
            callback = callback()
        if not isinstance(callback, TrainerCallback):
            raise ConfigError(
                f"callbacks[{index}] is a {type(callback).__name__}: give transformers.TrainerCallback instances "
                f"(gspo calls their {', '.join(EVENTS)})"
            )
        out.append(callback)
    return out


def _lora(peft_config: Any) -> dict[str, Any]:
    """lora.* of a peft LoraConfig (rank, alpha, dropout, target modules)."""
    if peft_config is None:
        return {}
    if not hasattr(peft_config, "r"):
        raise ConfigError(
            f"peft_config is a {type(peft_config).__name__}: gspo trains LoRA (peft.LoraConfig) only"
        )
    modules = peft_config.target_modules
    if isinstance(modules, str):
        raise ConfigError(
            f"peft_config.target_modules={modules!r}: name the modules, e.g. target_modules=['q_proj', 'k_proj', "
            "'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj']"
        )
    out = {"rank": peft_config.r, "alpha": float(peft_config.lora_alpha), "dropout": peft_config.lora_dropout}
    return out | ({"target_modules": sorted(modules)} if modules else {})


def _check_eval_dataset(eval_dataset: Any, columns: list[str]) -> None:
    """An eval_dataset has rows and every column of train_dataset, which the reward functions get."""
    if eval_dataset is None:
        return
    _rows(eval_dataset, "eval_dataset")
    missing = [c for c in columns if c not in _columns(eval_dataset, "eval_dataset")]
    if missing:
        raise ConfigError(
            f"eval_dataset has no column {missing[0]!r}, which train_dataset has and the reward functions "
            "get: give both the same columns"
        )
