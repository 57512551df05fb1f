"""TRL's GRPOTrainer and GRPOConfig over gspo: code written for TRL runs with one change, its import.

    from gspo.trl import GRPOConfig, GRPOTrainer      # was: from trl import GRPOConfig, GRPOTrainer

    trainer = GRPOTrainer(model="Qwen/Qwen2-0.5B-Instruct", reward_funcs=reward_len,
                          args=GRPOConfig(output_dir="Qwen2-0.5B-GRPO"), train_dataset=dataset)
    trainer.train()

GRPOConfig takes TRL's names for what gspo has (gspo.config.trl translates each: the loss pair, the batch
names, the counts) and refuses what gspo lacks by name, saying what to use instead; `gspo={...}` takes
gspo's own keys as `Config`'s keyword arguments, applied last. A name left out has TRL's default, but for
the loss: importance_sampling_level="sequence" and loss_type="grpo", TRL's GSPO recipe, with the paper's
clip range (epsilon and epsilon_high unset). GRPOTrainer trains `train_dataset` through gspo's `train`,
into the run folder output_dir; reward functions get TRL's keywords: `prompts` (the dataset's own prompts),
`completions` (texts, or `[{"role": "assistant", "content": ...}]` for a conversational dataset) and every
other column.

Departures from TRL, each for a reason gspo states elsewhere:
- a text prompt is the user message of the model's chat template (TRL feeds it to the model as written);
- reward functions get no `completion_ids`, `trainer_state`, `log_extra` or `log_metric`;
- no evaluation unless `gspo={"task": {"num_eval": N}}` holds rows of train_dataset out (no eval_dataset);
- the run length is max_steps, else num_train_epochs over train_dataset's rows, in rollout batches;
- save_total_limit=None keeps gspo's one checkpoint (TRL keeps all); logging_steps,
  gradient_checkpointing and log_completions change nothing (gspo logs every step and bounds memory with
  train.micro_batch_tokens).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gspo.config import Config, ConfigError, validate
from gspo.config.trl import (
    LACKING,
    RENAMED,
    TRL_LOSSES,
    TrlValueError,
    batch_shape,
    loss_keys,
    nested,
    translate,
)
from gspo.config.values import shown
from gspo.training.inputs import named_rewards
from gspo.training.launch import train as gspo_train

__all__ = ["GRPOConfig", "GRPOTrainer"]


@dataclass
class GRPOConfig:
    """TRL's GRPOConfig names gspo honours (module docstring); defaults are TRL's but for the loss."""

    output_dir: str | None = None
    seed: int = 42
    # the loss: TRL's GSPO recipe; epsilon / epsilon_high None: the objective's paper defaults
    importance_sampling_level: str | None = None
    """None: "sequence" (GSPO) where loss_type has a sequence form, else TRL's "token"."""
    loss_type: str = "grpo"
    epsilon: float | None = None
    epsilon_high: float | None = None
    sapo_temperature_pos: float | None = None
    sapo_temperature_neg: float | None = None
    beta: float = 0.0
    scale_rewards: str | bool = "group"
    mask_truncated_completions: bool = False
    off_policy_mask_threshold: float | None = None
    # the batch and the run's length
    num_generations: int = 8
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    steps_per_generation: int | None = None
    generation_batch_size: int | None = None
    num_iterations: int = 1
    max_steps: int = -1
    num_train_epochs: float = 3.0
    # sampling
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    use_vllm: bool = False
    vllm_mode: str = "colocate"
    # the optimizer
    learning_rate: float = 1e-6
    lr_scheduler_type: str = "linear"
    warmup_steps: float = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    max_grad_norm: float = 1.0
    bf16: bool | None = None
    reward_weights: list[float] | None = None
    # checkpoints, logging
    save_steps: int = 500
    save_total_limit: int | None = None
    save_only_model: bool = False
    report_to: str | list[str] = "none"
    logging_steps: float = 10
    gradient_checkpointing: bool = True
    log_completions: bool = False
    # TRL's settings gspo lacks: their TRL defaults are taken (they change nothing), others refused
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    fp16: bool = False
    delta: float | None = None
    num_generations_eval: int | None = None
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    sync_ref_model: bool = False
    multi_objective_aggregation: str = "sum_then_normalize"
    use_liger_kernel: bool = False
    warmup_ratio: float | None = None
    eval_strategy: str = "no"
    do_eval: bool = False
    vllm_server_base_url: str | None = None
    use_transformers_continuous_batching: bool = False
    vllm_importance_sampling_correction: bool = True
    gspo: dict[str, Any] = field(default_factory=dict)
    """gspo's own keys, as `Config`'s keyword arguments (`gspo={"task": {"num_eval": 20}}`), applied last."""

    def __new__(cls, *args: Any, **kwargs: Any) -> GRPOConfig:
        # before the dataclass's __init__, whose TypeError for an unknown keyword names no fix
        names = {f.name for f in dataclasses.fields(cls)}
        for name in kwargs:
            if name not in names:
                raise ConfigError(_unknown(name, names))
        return super().__new__(cls)

    def __post_init__(self) -> None:
        for name in LACKING:
            _translated(name, getattr(self, name))  # TRL's default passes; another value names what to use
        self.gspo_config(rows=None, reward_names=[])  # every value checked now, at the line that set it

    def gspo_config(self, *, rows: int | None, reward_names: Sequence[str]) -> Config:
        """The gspo Config of these settings, checked, for a run on `rows` rows of train_dataset (None: its
        length is left as gspo's default) with reward functions of these names (reward_weights pairs them)."""
        keys, origin = self._keys(reward_names)
        try:
            config = Config(**_merge(nested(keys), self.gspo))
        except ConfigError as error:
            raise self._said_of(error, origin) from None
        length_known = rows is not None or self.max_steps > 0 or self.num_train_epochs <= 0
        if length_known and "steps" not in self.gspo.get("train", {}):
            config.train.steps = self._steps((rows or 0) - config.task.num_eval, keys)
        try:  # what relates several keys: a GRPOConfig's values together
            validate(config)
        except ConfigError as error:
            raise self._said_of(error, origin) from None
        return config

    def _said_of(self, error: ConfigError, origin: dict[str, str]) -> ConfigError:
        """A gspo key's error said of the GRPOConfig setting that gave the key (message: "KEY ...")."""
        key = str(error).split(" ", 1)[0].rstrip(":")
        if key in origin:
            name = origin[key]
            return ConfigError(f"GRPOConfig({name}={getattr(self, name)!r}): {error}")
        return ConfigError(f"GRPOConfig(gspo={shown(self.gspo)}): {error}")

    def _keys(self, reward_names: Sequence[str]) -> tuple[dict[str, Any], dict[str, str]]:
        """gspo's dotted keys of every setting, and which TRL name set each."""
        keys: dict[str, Any] = {}
        origin: dict[str, str] = {}

        def put(name: str, values: Mapping[str, Any]) -> None:
            keys.update(values)
            origin.update(dict.fromkeys(values, name))

        for name in ("learning_rate", "num_generations", "max_completion_length", "beta", "temperature"):
            put(name, {RENAMED[name]: getattr(self, name)})
        for name in ("top_p", "mask_truncated_completions", "weight_decay", "max_grad_norm"):
            put(name, {RENAMED[name]: getattr(self, name)})
        put("max_completion_length", {"eval.max_new_tokens": self.max_completion_length})
        put("seed", {"seed": self.seed})
        if self.output_dir is not None:
            put("output_dir", {"output_dir": self.output_dir})
        if self.off_policy_mask_threshold is not None:
            put("off_policy_mask_threshold", {"train.opsm_delta": self.off_policy_mask_threshold})
        for key, value in self._loss().items():  # each knob said of the TRL name that set it
            name = {"train.objective": "loss_type", "train.aggregation": "loss_type"}.get(key)
            name = name or {
                "train.tau_pos": "sapo_temperature_pos",
                "train.tau_neg": "sapo_temperature_neg",
            }.get(key)
            high = "epsilon_high" if self.epsilon_high is not None else "epsilon"
            put(name or ("epsilon" if key == "train.eps_low" else high), {key: value})
        for name in ("scale_rewards", "bf16", "lr_scheduler_type", "save_only_model", "report_to"):
            if name == "report_to":
                put(name, {"report_to": self.report_to})
                continue
            put(name, _translated(name, getattr(self, name)).keys)
        if self.use_vllm:
            put("vllm_mode", _translated("vllm_mode", self.vllm_mode).keys)
        put("adam_beta1", {"train.adam_betas": [self.adam_beta1, self.adam_beta2]})
        shape = _refused_as("num_iterations", lambda: batch_shape(**self._batch(), world_size=_world_size()))
        put("per_device_train_batch_size", shape)
        updates = shape["train.minibatches"]  # TRL's counts are optimizer updates; gspo's rollout batches
        put("save_steps", {"checkpoint.every": max(1, math.ceil(self.save_steps / updates))})
        if self.save_total_limit is not None:
            put("save_total_limit", {"checkpoint.keep": self.save_total_limit})
        warmup = self.warmup_steps
        if 0 < warmup < 1:  # a share of every update, as transformers reads it
            total = self._steps_hint(keys) * updates
            warmup = math.ceil(warmup * total) if total else 0
        put("warmup_steps", {"train.warmup_updates": int(warmup)})
        put("eval_strategy", {"task.num_eval": 0, "eval.every": 0})  # TRL evaluates nothing by default
        if self.reward_weights is not None and reward_names:  # paired with the functions' names
            put("reward_weights", {"rewards": self._weights(reward_names)})
        return keys, origin

    def _loss(self) -> dict[str, Any]:
        """train.objective, train.aggregation and the knobs TRL's loss reads for this loss_type."""
        level = self.importance_sampling_level
        if level is None:
            level = "sequence" if (self.loss_type, "sequence") in TRL_LOSSES else "token"
        keys = _refused_as("loss_type", lambda: loss_keys(self.loss_type, level))
        if self.loss_type == "sapo":  # TRL's SAPO reads its temperatures, not epsilon
            for name, key in (
                ("sapo_temperature_pos", "train.tau_pos"),
                ("sapo_temperature_neg", "train.tau_neg"),
            ):
                if getattr(self, name) is not None:
                    keys[key] = getattr(self, name)
        elif self.loss_type == "cispo":  # TRL caps the weight at epsilon_high itself; gspo at 1 + eps_high
            if self.epsilon_high is not None:
                keys |= {"train.eps_low": 1.0, "train.eps_high": self.epsilon_high - 1.0}
        else:  # TRL's epsilon sets both sides unless epsilon_high is given
            if self.epsilon is not None:
                keys["train.eps_low"] = self.epsilon
            high = self.epsilon_high if self.epsilon_high is not None else self.epsilon
            if high is not None:
                keys["train.eps_high"] = high
        return keys

    def _batch(self) -> dict[str, Any]:
        names = ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation")
        names += ("generation_batch_size", "num_generations", "num_iterations")
        return {name: getattr(self, name) for name in names}

    def _steps_hint(self, keys: dict[str, Any]) -> int:
        """The run's rollout batches where they are known without the data (max_steps), else 0."""
        return math.ceil(self.max_steps / keys["train.minibatches"]) if self.max_steps > 0 else 0

    def _steps(self, rows: int, keys: dict[str, Any]) -> int:
        """train.steps: max_steps optimizer updates in rollout batches of train.minibatches updates, else
        num_train_epochs passes over the training rows in rollout batches of rollout.prompts_per_step."""
        updates = keys["train.minibatches"]
        if self.max_steps > 0:
            if self.max_steps % updates:
                raise TrlValueError(
                    f"GRPOConfig: max_steps={self.max_steps} is not a multiple of the {updates} optimizer updates of "
                    "each rollout batch (steps_per_generation / gradient_accumulation_steps)",
                    {"max_steps": math.ceil(self.max_steps / updates) * updates},
                )
            return self.max_steps // updates
        if self.num_train_epochs <= 0:
            raise TrlValueError(
                f"GRPOConfig: num_train_epochs={self.num_train_epochs} with max_steps={self.max_steps} trains nothing",
                {"num_train_epochs": 1.0},
            )
        return max(1, math.ceil(self.num_train_epochs * max(rows, 1) / keys["rollout.prompts_per_step"]))

    def _weights(self, reward_names: Sequence[str]) -> dict[str, float]:
        weights = list(self.reward_weights or [])
        if len(weights) != len(reward_names):
            raise ConfigError(
                f"GRPOConfig(reward_weights={weights}) has {len(weights)} weights for {len(reward_names)} reward "
                f"functions ({', '.join(reward_names)}): give one per function, in their order"
            )
        return dict(zip(reward_names, weights, strict=True))


def _translated(name: str, value: Any) -> Any:
    """gspo.config.trl's translation, its refusal as one line naming the GRPOConfig setting."""
    return _refused_as(name, lambda: translate(name, value))


def _refused_as(name: str, build: Callable[[], Any]) -> Any:
    """`build()`, a refusal of gspo.config.trl's said of GRPOConfig (its `instead`: GRPOConfig keywords)."""
    try:
        return build()
    except TrlValueError as error:
        raise TrlValueError(f"GRPOConfig: {error.problem}", error.instead) from None


def _unknown(name: str, names: set[str]) -> str:
    """The message for a keyword GRPOConfig does not take."""
    import difflib

    close = difflib.get_close_matches(name, sorted(names), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (
        f"GRPOConfig has no setting {name!r} that gspo honours{hint}: gspo's own keys go in gspo={{...}}, as "
        "Config's keyword arguments (`gspo config` lists them): e.g. GRPOConfig(gspo={'task': {'num_eval': 20}})"
    )


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `extra`'s keys set over it, section by section."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


RewardFunc = Callable[..., Any]

IGNORED_COLUMNS = ("completion", "completion_ids")
"""Columns TRL does not pass to reward functions (a prompt-completion dataset's reference completion)."""


class GRPOTrainer:
    """TRL's GRPOTrainer's signature over gspo's `train` (module docstring). Settings are checked here,
    at construction; `train()` runs."""

    def __init__(
        self,
        model: Any,
        reward_funcs: RewardFunc | list[RewardFunc] | None = None,
        args: GRPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: Any = None,
        optimizers: tuple[Any, Any] = (None, None),
        peft_config: Any = None,
        **others: Any,
    ) -> None:
        _refuse(
            {
                "eval_dataset": eval_dataset,
                "processing_class": processing_class,
                "reward_processing_classes": reward_processing_classes,
                "callbacks": callbacks,
                "optimizers": None if optimizers == (None, None) else optimizers,
                **others,
            }
        )
        self.args = args if args is not None else GRPOConfig()
        self.model_path = _model_path(model)
        functions = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        for function in functions:
            _check_reward_function(function)
        self.train_dataset = train_dataset
        columns = _columns(train_dataset)
        self.reward_funcs = [_trl_call(function, _conversational(train_dataset)) for function in functions]
        names = list(named_rewards(self.reward_funcs))  # each by its function's name, as TRL names them
        config = self.args.gspo_config(rows=_rows(train_dataset), reward_names=names)
        lora = _lora(peft_config)
        self.config = dataclasses.replace(
            config,
            model=dataclasses.replace(config.model, path=self.model_path, tiny=None),
            task=dataclasses.replace(
                config.task, answer_fields=[c for c in columns if c not in IGNORED_COLUMNS]
            ),
            **({"lora": dataclasses.replace(config.lora, **lora)} if lora else {}),
        )
        validate(self.config)
        self.result: dict[str, Any] | None = None

    def train(self, resume_from_checkpoint: bool | str | None = None) -> dict[str, Any]:
        """Train, as TRL's trainer.train(); ``resume_from_checkpoint``: True continues this run's folder
        (output_dir), a path continues that run folder. Returns gspo's result (the run folder, the first
        and last eval accuracy)."""
        resume = None
        if resume_from_checkpoint:
            resume = self.config.output_dir if resume_from_checkpoint is True else str(resume_from_checkpoint)
            if resume is None:
                raise ConfigError(
                    "train(resume_from_checkpoint=True) needs GRPOConfig(output_dir=...), the run"
                )
            self.result = gspo_train(resume=resume, reward_functions=self.reward_funcs)
        else:
            self.result = gspo_train(self.config, reward_functions=self.reward_funcs, data=self.train_dataset)
        return self.result

    def save_model(self, output_dir: str | None = None) -> Path:
        """The trained weights as a Hugging Face folder (LoRA merged): `output_dir`, or RUN/export/ when it
        is None or the run folder itself (gspo's run folder holds checkpoints, not a model); returns it."""
        from gspo.training.export import export_run

        if self.result is None:
            raise RuntimeError("save_model() comes after train(): there is no trained model yet")
        run = Path(self.result["run_dir"])
        inside = output_dir is None or Path(output_dir).resolve() == run.resolve()
        return export_run(run, format="hf", output=None if inside else output_dir)


REFUSED_ARGUMENTS = {
    "eval_dataset": "gspo evaluates on rows of train_dataset it holds out: use "
    "args=GRPOConfig(gspo={'task': {'num_eval': 20}})",
    "processing_class": "gspo loads the model's own tokenizer: leave it out",
    "reward_processing_classes": "gspo's rewards are functions: leave it out",
    "callbacks": "gspo logs each step to metrics.jsonl and report_to's trackers: leave it out",
    "optimizers": "gspo trains with AdamW and GRPOConfig's learning_rate, lr_scheduler_type: leave it out",
}
"""GRPOTrainer's arguments gspo takes only unset, and what to do instead."""


def _refuse(given: dict[str, Any]) -> None:
    """One line for the first argument given that gspo has no use for (`REFUSED_ARGUMENTS`, or any other
    of TRL's: tools, rollout_func, environment_factory, quantization_config)."""
    for name, value in given.items():
        if value is not None and value != []:
            instead = REFUSED_ARGUMENTS.get(name, "gspo has no such argument: leave it out")
            raise ConfigError(f"GRPOTrainer({name}=...): {instead}")


def _rows(dataset: Any) -> int:
    """The dataset's number of rows; a dataset without one (an IterableDataset) is refused."""
    try:
        return len(dataset)
    except TypeError:
        raise ConfigError(
            f"train_dataset is a {type(dataset).__name__} without a length: gspo draws its rollout batches "
            "from rows it holds, a datasets.Dataset (dataset = Dataset.from_list(list(iterable)))"
        ) from None


def _model_path(model: Any) -> str:
    """model= as model.path: a hub id or a local folder; a model object is named by the fix."""
    if isinstance(model, (str, Path)):
        return str(model)
    name = getattr(getattr(model, "config", None), "name_or_path", None) or getattr(
        model, "name_or_path", None
    )
    known = f" (this one's is {name!r}: model={name!r})" if name else ""
    raise ConfigError(
        f"GRPOTrainer(model=<{type(model).__name__}>): gspo loads the model itself, from a hub id in your Hugging "
        f"Face cache or a local folder: pass that{known}, or save it first (model.save_pretrained(DIR), "
        "model=DIR)"
    )


def _check_reward_function(function: Any) -> None:
    """A callable, not a reward model's id or object (TRL takes those; gspo rewards are functions)."""
    if isinstance(function, str) or hasattr(function, "forward") or not callable(function):
        raise ConfigError(
            f"reward_funcs={shown(function)}: gspo's rewards are Python functions, "
            "def reward(completions, **kwargs) -> list[float]; a reward model (an id or a model) is not supported: "
            "score with it inside such a function"
        )


def _columns(dataset: Any) -> list[str]:
    """The dataset's columns, the prompt among them (TRL's name for it)."""
    if dataset is None:
        raise ConfigError("GRPOTrainer needs train_dataset: a datasets.Dataset with a 'prompt' column")
    names = getattr(dataset, "column_names", None)
    if names is None and isinstance(dataset, Sequence) and dataset and isinstance(dataset[0], Mapping):
        names = list(dataset[0])
    if names is None:
        raise ConfigError(
            f"train_dataset is a {type(dataset).__name__}: give a datasets.Dataset (or a list of dicts) with a "
            "'prompt' column"
        )
    if "prompt" not in names:
        raise ConfigError(
            f"train_dataset has no 'prompt' column (its columns: {list(names)}): TRL's name for it"
        )
    return list(names)


def _conversational(dataset: Any) -> bool:
    """TRL's test: the first row's prompt is a list of messages."""
    first = dataset[0]["prompt"]
    return isinstance(first, list) and bool(first) and isinstance(first[0], Mapping) and "role" in first[0]


def _trl_call(function: RewardFunc, conversational: bool) -> RewardFunc:
    """`function` called as TRL calls it: `prompts` are the dataset's own (the prompt column, which the run
    passes among the fields; gspo's are the templated texts), completions of a conversational dataset are
    assistant messages, the other columns keywords."""

    @functools.wraps(function)
    def call(prompts: list[Any], completions: list[str], **fields: Any) -> Any:
        prompts = fields.pop("prompt", prompts)
        if conversational:
            completions = [[{"role": "assistant", "content": text}] for text in completions]
        return function(prompts=prompts, completions=completions, **fields)

    return call


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
