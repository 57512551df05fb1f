"""GRPOConfig: TRL's names for a run (gspo.trl's docstring), each checked as it is set and translated into
gspo's keys by gspo.config.trl's table; `GRPOConfig.gspo_config` is the run's `Config`."""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gspo.config import Config, ConfigError, validate
from gspo.config.trl import (
    RENAMED,
    TRL_BATCH_DEFAULTS,
    TRL_LOSSES,
    TrlValueError,
    batch_shape,
    check_range,
    loss_keys,
    nested,
    translate,
)
from gspo.config.values import shown
from gspo.parallel.group import launched_world_size
from gspo.trl.checks import check_type, unknown_name


@dataclass
class GRPOConfig:
    """TRL's GRPOConfig names gspo honours (gspo.trl's docstring); defaults are TRL's but for the loss."""

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
    entropy_coef: float = 0.0
    use_adaptive_entropy: bool = False
    entropy_target: float = 0.2
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005
    # the batch and the run's length
    num_generations: int = 8
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    steps_per_generation: int | None = None
    generation_batch_size: int | None = None
    num_iterations: int = 1
    max_steps: int = -1
    num_train_epochs: float = 3.0
    # sampling and the model
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    generation_kwargs: dict[str, Any] | None = None
    use_vllm: bool = False
    vllm_mode: str = "colocate"
    model_init_kwargs: dict[str, Any] | None = None
    # the optimizer
    learning_rate: float = 1e-6
    lr_scheduler_type: str = "linear"
    warmup_steps: float = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    max_grad_norm: float = 1.0
    optim: str = "adamw_torch"
    bf16: bool | None = None
    reward_weights: list[float] | None = None
    # checkpoints, evaluation, logging
    save_strategy: str = "steps"
    save_steps: float = 500
    save_total_limit: int | None = None
    save_only_model: bool = False
    eval_strategy: str = "no"
    eval_steps: float | None = None
    per_device_eval_batch_size: int | None = None
    report_to: str | list[str] | None = "none"
    disable_tqdm: bool | None = None
    ddp_find_unused_parameters: bool | None = None
    # TRL's settings that change nothing in gspo, whatever their value (gspo.config.trl says why)
    max_prompt_length: int | None = None
    logging_steps: float = 10
    logging_strategy: str = "steps"
    logging_first_step: bool = False
    logging_dir: str | None = None
    run_name: str | None = None
    gradient_checkpointing: bool = True
    gradient_checkpointing_kwargs: dict[str, Any] | None = None
    log_completions: bool = False
    num_completions_to_print: int | None = None
    remove_unused_columns: bool | None = False
    dataloader_num_workers: int = 0
    disable_dropout: bool = False
    cast_lm_head_to_fp32: bool = False
    do_eval: bool = False
    hub_model_id: str | None = None
    # TRL's settings gspo lacks: their TRL defaults are taken (they change nothing), others refused
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    chat_template_kwargs: dict[str, Any] | None = None
    fp16: bool = False
    delta: float | None = None
    num_generations_eval: int | None = None
    top_entropy_quantile: float = 1.0
    entropy_coef_min: float = 0.0
    sync_ref_model: bool = False
    multi_objective_aggregation: str = "sum_then_normalize"
    use_liger_kernel: bool = False
    warmup_ratio: float | None = None
    vllm_server_base_url: str | None = None
    vllm_gpu_memory_utilization: float = 0.3
    vllm_tensor_parallel_size: int = 1
    use_transformers_continuous_batching: bool = False
    vllm_importance_sampling_correction: bool = True
    adam_epsilon: float = 1e-8
    lr_scheduler_kwargs: dict[str, Any] | None = None
    torch_compile: bool = False
    deepspeed: Any = None
    fsdp: Any = None
    trust_remote_code: bool = False
    push_to_hub: bool = False
    overwrite_output_dir: bool = False
    resume_from_checkpoint: str | None = None
    load_best_model_at_end: bool = False
    shuffle_dataset: bool = True
    data_seed: int | None = None
    save_safetensors: bool = True
    tools: Any = None
    max_tool_calling_iterations: int | None = None
    gspo: dict[str, Any] = field(default_factory=dict)
    """gspo's own keys, as `Config`'s keyword arguments (`gspo={"task": {"num_eval": 20}}`), applied last."""

    def __new__(cls, *args: Any, **kwargs: Any) -> GRPOConfig:
        # before the dataclass's __init__, whose TypeError for an unknown keyword names no fix
        for name, value in kwargs.items():
            if name not in _annotations():
                raise ConfigError(unknown_name(name, value, _annotations()))
        return super().__new__(cls)

    def __setattr__(self, name: str, value: Any) -> None:
        """Each value checked against its field's annotation and TRL's range, in the constructor as in an
        assignment (`args.max_steps = 10`)."""
        hints = _annotations()
        if name not in hints:
            raise ConfigError(unknown_name(name, value, _annotations()))
        check_type(name, value, hints[name], _DEFAULTS[name])
        check_range(name, value, _DEFAULTS[name], said=f"GRPOConfig({name}={shown(value)})")
        object.__setattr__(self, name, value)

    def __post_init__(self) -> None:
        self.gspo_config(rows=None, reward_names=[])  # every value checked now, at the line that set it

    def gspo_config(
        self,
        *,
        rows: int | None,
        reward_names: Sequence[str],
        holds_out: bool = True,
        given: Mapping[str, Any] | None = None,
    ) -> Config:
        """The gspo Config of these settings, checked, for a run on `rows` rows of train_dataset (None: its
        length is left as gspo's default) with rewards of these names, in reward_weights' order;
        ``holds_out``: task.num_eval of the rows are held out (no eval_dataset); ``given``: dotted keys
        that GRPOTrainer's arguments set (the model, the columns, a reward model, LoRA)."""
        keys, origin = self.settings(rows=rows, reward_names=reward_names, holds_out=holds_out, given=given)
        try:
            config = Config(**_merge(nested(keys), self.gspo))
            validate(config)  # what relates several keys: a GRPOConfig's values together
        except ConfigError as error:
            raise self._said_of(error, origin) from None
        return config

    def _said_of(self, error: ConfigError, origin: dict[str, str]) -> ConfigError:
        """A gspo key's error said of the GRPOConfig setting that gave the key (message: "KEY ...")."""
        key = str(error).split(" ", 1)[0].rstrip(":")
        name = origin.get(key)
        if name == "GRPOTrainer":
            return ConfigError(f"GRPOTrainer: {error}")
        if name is not None:
            return ConfigError(f"GRPOConfig({name}={shown(getattr(self, name))}): {error}")
        return ConfigError(f"GRPOConfig(gspo={shown(self.gspo)}): {error}")

    def settings(
        self,
        *,
        rows: int | None,
        reward_names: Sequence[str],
        holds_out: bool = True,
        given: Mapping[str, Any] | None = None,
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """gspo's dotted keys of every setting and of GRPOTrainer's arguments (``given``; gspo= applies over
        them all), and which TRL name set each ("GRPOTrainer": an argument)."""
        keys: dict[str, Any] = {}
        origin: dict[str, str] = {}

        def put(name: str, values: Mapping[str, Any]) -> None:
            keys.update(values)
            origin.update(dict.fromkeys(values, name))

        put("GRPOTrainer", given or {})

        put("seed", {"seed": self.seed})
        put("report_to", {"report_to": self.report_to})
        if self.output_dir is not None:
            put("output_dir", {"output_dir": self.output_dir})
        for name, value in ((f.name, getattr(self, f.name)) for f in dataclasses.fields(self)):
            if name not in JOINT and not (name in RENAMED and value is None):  # None: TRL's "unset"
                put(name, _translated(name, value).keys)
        for key, value in self._loss().items():
            put(_LOSS_ORIGIN.get(key) or self._epsilon_origin(key), {key: value})
        for name, values in self._sampling():
            put(name, values)
        put("adam_beta1", {"train.adam_betas": [self.adam_beta1, self.adam_beta2]})
        if self.use_adaptive_entropy:
            put("use_adaptive_entropy", {"train.entropy_target": self.entropy_target})
        # the batch, then the counts: TRL's are optimizer updates (below 1: a share of all of them)
        shape = _refused(lambda: batch_shape(**self._batch(), world_size=launched_world_size()))
        put("per_device_train_batch_size", shape)
        updates = shape["train.minibatches"]
        held = _gspo_value(self.gspo, "task.num_eval") if holds_out else None
        steps = self._steps(rows, held if isinstance(held, int) else 0, shape)
        own = _gspo_value(self.gspo, "train.steps")
        if steps is not None and own is None:
            put("max_steps" if self.max_steps > 0 else "num_train_epochs", {"train.steps": steps})
        total = (own if isinstance(own, int) else steps or 0) * updates

        def batches(count: float) -> int:
            """Rollout batches of TRL's count of optimizer updates."""
            if count < 1:
                count = math.ceil(count * total)
            return max(1, math.ceil(count / updates))

        put("save_strategy", _translated("save_strategy", self.save_strategy).keys)
        if self.save_strategy == "steps":
            put("save_steps", {"checkpoint.every": batches(self.save_steps)})
        put("eval_strategy", {"task.num_eval": 0, **_translated("eval_strategy", self.eval_strategy).keys})
        if self.eval_strategy == "steps":  # TRL's eval_steps None: logging_steps
            count = self.eval_steps if self.eval_steps is not None else self.logging_steps
            put("eval_steps", {"eval.every": batches(count)})
        put("warmup_steps", {"train.warmup_updates": self._warmup_updates(total)})
        if reward_names:  # each reward by its name, reward_weights in their order
            put("reward_weights", {"rewards": self._weights(reward_names)})
        return keys, origin

    def _warmup_updates(self, total: int) -> int:
        """warmup_steps in optimizer updates: below 1, a share of all ``total`` of them, as transformers reads
        it."""
        warmup = self.warmup_steps
        if 0 < warmup < 1:
            warmup = math.ceil(warmup * total) if total else 0
        return int(warmup)

    def _sampling(self) -> list[tuple[str, Mapping[str, Any]]]:
        """The sampler's keys by the TRL name that sets each: generation_kwargs over the rest, as TRL applies
        them."""
        length = self.max_completion_length
        keys: list[tuple[str, Mapping[str, Any]]] = [
            ("max_completion_length", {"rollout.max_new_tokens": length, "eval.max_new_tokens": length}),
            ("temperature", {"rollout.temperature": self.temperature}),
            ("top_p", {"rollout.top_p": self.top_p}),
            ("generation_kwargs", _translated("generation_kwargs", self.generation_kwargs).keys),
            ("use_vllm", _translated("use_vllm", self.use_vllm).keys),
        ]
        if self.use_vllm:
            keys.append(("vllm_mode", _translated("vllm_mode", self.vllm_mode).keys))
        return keys

    def _loss(self) -> dict[str, Any]:
        """train.objective, train.aggregation and the knobs TRL's loss reads for this loss_type."""
        level = self.importance_sampling_level
        if level is None:
            level = "sequence" if (self.loss_type, "sequence") in TRL_LOSSES else "token"
        keys = _refused(lambda: loss_keys(self.loss_type, level))
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

    def _epsilon_origin(self, key: str) -> str:
        if key == "train.eps_low":
            return "epsilon"
        return "epsilon_high" if self.epsilon_high is not None else "epsilon"

    def _batch(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in TRL_BATCH_DEFAULTS}

    def _steps(self, rows: int | None, held: int, shape: dict[str, Any]) -> int | None:
        """train.steps: max_steps optimizer updates in rollout batches of train.minibatches updates, else
        num_train_epochs passes over the training rows (`rows` less `held` out) in rollout batches of
        rollout.prompts_per_step; None: not known without the rows."""
        updates = shape["train.minibatches"]
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
        if rows is None:
            return None
        prompts = shape["rollout.prompts_per_step"]
        return max(1, math.ceil(self.num_train_epochs * max(rows - held, 1) / prompts))

    def _weights(self, reward_names: Sequence[str]) -> dict[str, float]:
        if self.reward_weights is None:
            return dict.fromkeys(reward_names, 1.0)
        weights = list(self.reward_weights)
        if len(weights) != len(reward_names):
            raise ConfigError(
                f"GRPOConfig(reward_weights={weights}) has {len(weights)} weights for {len(reward_names)} reward "
                f"functions ({', '.join(reward_names)}): give one per function, in their order"
            )
        return dict(zip(reward_names, weights, strict=True))


JOINT = frozenset(
    {
        *("output_dir", "seed", "report_to", "gspo", "reward_weights", "adam_beta1", "adam_beta2"),
        *("importance_sampling_level", "loss_type", "epsilon", "epsilon_high"),
        *("sapo_temperature_pos", "sapo_temperature_neg", "use_adaptive_entropy", "entropy_target"),
        *TRL_BATCH_DEFAULTS,
        *("max_steps", "num_train_epochs", "save_strategy", "save_steps", "eval_strategy", "eval_steps"),
        *("warmup_steps", "max_completion_length", "temperature", "top_p", "generation_kwargs"),
        *("use_vllm", "vllm_mode"),
    }
)
"""GRPOConfig's names that `settings` translates together with others (the rest: one by one)."""

_LOSS_ORIGIN = {
    "train.objective": "loss_type",
    "train.aggregation": "loss_type",
    "train.tau_pos": "sapo_temperature_pos",
    "train.tau_neg": "sapo_temperature_neg",
}
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GRPOConfig)} | {"gspo": {}}


@functools.cache
def _annotations() -> dict[str, Any]:
    return typing.get_type_hints(GRPOConfig)


def _translated(name: str, value: Any) -> Any:
    """gspo.config.trl's translation, its refusal as one line naming the GRPOConfig setting."""
    return _refused(lambda: translate(name, value))


def _refused(build: Callable[[], Any]) -> Any:
    """`build()`, a refusal of gspo.config.trl's said of GRPOConfig (its `instead`: GRPOConfig keywords)."""
    try:
        return build()
    except TrlValueError as error:
        raise TrlValueError(f"GRPOConfig: {error.problem}", error.instead) from None


def _gspo_value(values: Mapping[str, Any], key: str) -> Any:
    """gspo='s value of a dotted key, or None where it sets none."""
    for part in key.split("."):
        if not isinstance(values, Mapping):
            return None
        values = values.get(part)  # type: ignore[assignment]
    return values


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `extra`'s keys set over it, section by section."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out
