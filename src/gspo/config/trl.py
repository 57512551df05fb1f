"""TRL's GRPOConfig names in gspo's words: what each one is among gspo's keys, and what to use where gspo
has no such setting. One table, read by the config's hints (a TRL name given to `Config`, a YAML file or
an override) and by gspo.trl's GRPOConfig, which takes the names themselves.

`translate` takes a name and the value a TRL user writes and gives gspo's keys and values (dotted), or
raises `TrlValueError` whose ``instead`` names GRPOConfig keywords that work. Counts translate under TRL's
default batch shape (one optimizer update per rollout batch), where TRL's optimizer steps and gspo's
rollout batches agree. `TRL_RANGES` holds the ranges of the names that have no gspo key to check them.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gspo.config.values import ConfigError, shown

TRL_LOSSES: dict[tuple[str, str], tuple[str, str]] = {
    ("grpo", "token"): ("grpo", "seq-mean-token-mean"),
    ("grpo", "sequence"): ("gspo", "seq-mean-token-mean"),  # TRL's GSPO recipe: the paper's setup
    ("dapo", "token"): ("grpo", "token-mean"),
    ("bnpo", "token"): ("grpo", "token-mean"),  # one process; across ranks gspo's mean is global (dapo's)
    ("dapo", "sequence"): ("gspo", "token-mean"),
    ("luspo", "sequence"): ("gspo", "seq-mean-token-sum"),
    ("dr_grpo", "token"): ("grpo", "seq-mean-token-sum-norm"),
    ("sapo", "token"): ("sapo", "seq-mean-token-mean"),
    ("sapo", "sequence"): ("sapo_seq", "seq-mean-token-mean"),
    ("cispo", "token"): ("cispo", "token-mean"),
}
"""(loss_type, importance_sampling_level) -> (train.objective, train.aggregation): each pair's loss and
gradient equal TRL's own loss code's (tests/test_peers.py runs this table against TRL's GRPOTrainer)."""

GSPO_RECIPE = {"loss_type": "grpo", "importance_sampling_level": "sequence"}
"""TRL's names for GSPO as the paper runs it (TRL's own GSPO recipe): gspo.trl's defaults."""

TRL_BATCH_DEFAULTS: dict[str, Any] = {
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "steps_per_generation": None,
    "generation_batch_size": None,
    "num_generations": 8,
    "num_iterations": 1,
}
"""TRL's defaults of the names that shape its batch (GRPOConfig and transformers' TrainingArguments)."""


class TrlValueError(ConfigError):
    """A TRL name with a value gspo cannot take. ``instead``: gspo.trl's GRPOConfig keywords that work in
    its place (TRL's names, or ``gspo={...}`` for gspo's own keys; empty: leave it out); the message ends
    with them."""

    def __init__(self, problem: str, instead: dict[str, Any]) -> None:
        self.problem, self.instead = problem, instead
        fix = ", ".join(f"{name}={value!r}" for name, value in instead.items())
        super().__init__(f"{problem}: use {fix}" if instead else f"{problem}: leave it out")


@dataclass(frozen=True)
class Translation:
    """A TRL name's gspo keys and values (dotted), and what a hint adds: what differs, or what it means."""

    keys: dict[str, Any]
    note: str = ""


TRL_RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "per_device_train_batch_size": (lambda v: v >= 1, "at least 1"),
    "gradient_accumulation_steps": (lambda v: v >= 1, "at least 1"),
    "steps_per_generation": (lambda v: v >= 1, "at least 1 (None: gradient_accumulation_steps)"),
    "generation_batch_size": (lambda v: v >= 1, "at least 1 (None: from the batch names)"),
    "num_iterations": (lambda v: v >= 1, "at least 1"),
    "num_generations": (lambda v: v >= 2, "at least 2 (advantages compare the completions of a prompt)"),
    "max_completion_length": (lambda v: v >= 1, "at least 1"),
    "save_steps": (lambda v: v > 0, "> 0 (below 1: a share of the run's updates)"),
    "eval_steps": (lambda v: v > 0, "> 0 (below 1: a share of the run's updates; None: logging_steps)"),
    "logging_steps": (lambda v: v > 0, "> 0"),
    "warmup_steps": (lambda v: v >= 0, "at least 0 (below 1: a share of the run's updates)"),
}
"""What the TRL names without a gspo key of their own must be (the others: their gspo key's rule)."""


def check_range(name: str, value: Any, example: Any, said: str | None = None) -> None:
    """A TrlValueError naming ``example`` where `TRL_RANGES` refuses ``value`` (None: unset, not checked);
    its message starts with ``said`` (default: NAME=VALUE)."""
    if name not in TRL_RANGES or value is None:
        return
    test, must = TRL_RANGES[name]
    said = said or f"{name}={shown(value)}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TrlValueError(f"{said}: {name} is a number, {must}", {name: example})
    if not test(value):
        raise TrlValueError(f"{said}: {name} is {must}", {name: example})


def loss_keys(loss_type: str, level: str) -> dict[str, Any]:
    """train.objective and train.aggregation of TRL's loss_type at importance_sampling_level."""
    if (loss_type, level) in TRL_LOSSES:
        objective, aggregation = TRL_LOSSES[loss_type, level]
        return {"train.objective": objective, "train.aggregation": aggregation}
    if level not in ("token", "sequence"):
        raise TrlValueError(f"importance_sampling_level={level!r} is not 'token' or 'sequence'", GSPO_RECIPE)
    types = sorted({t for t, _ in TRL_LOSSES})
    if loss_type not in types:
        raise TrlValueError(f"loss_type={loss_type!r} is not one gspo has ({', '.join(types)})", GSPO_RECIPE)
    (other,) = [lv for t, lv in TRL_LOSSES if t == loss_type]
    raise TrlValueError(
        f"loss_type={loss_type!r} at importance_sampling_level={level!r} is not one gspo has",
        {"loss_type": loss_type, "importance_sampling_level": other},
    )


def _micro_steps(
    share: int, steps_per_generation: int | None, generation_batch_size: int | None, accumulation: int
) -> int:
    """The micro-steps of one rollout batch (TRL's steps_per_generation), each ``share`` completions: given,
    from generation_batch_size, or TRL's default, gradient_accumulation_steps."""
    if steps_per_generation is not None and generation_batch_size is not None:
        raise TrlValueError(
            "generation_batch_size and steps_per_generation are both set (TRL refuses it too)",
            {"steps_per_generation": steps_per_generation},
        )
    if generation_batch_size is None:
        return accumulation if steps_per_generation is None else steps_per_generation
    if generation_batch_size % share:
        raise TrlValueError(
            f"generation_batch_size={generation_batch_size} is not a multiple of per_device_train_batch_size"
            f" x processes = {share}",
            {"generation_batch_size": max(1, generation_batch_size // share) * share},
        )
    return generation_batch_size // share


def batch_shape(
    *,
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int,
    steps_per_generation: int | None,
    generation_batch_size: int | None,
    num_generations: int,
    num_iterations: int,
    world_size: int = 1,
) -> dict[str, Any]:
    """rollout.prompts_per_step, rollout.group_size and train.minibatches of TRL's batch names.

    TRL samples generation_batch_size completions (default: per_device_train_batch_size x processes x
    steps_per_generation, which defaults to gradient_accumulation_steps), num_generations of each prompt,
    and makes steps_per_generation / gradient_accumulation_steps optimizer updates on shares of them, in
    num_iterations passes. gspo's rollout batch: prompts_per_step x group_size completions, and
    train.minibatches updates in one pass.
    """
    given = {
        "per_device_train_batch_size": per_device_train_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "steps_per_generation": steps_per_generation,
        "generation_batch_size": generation_batch_size,
        "num_generations": num_generations,
        "num_iterations": num_iterations,
    }
    for name, value in given.items():  # a 0 here divides by zero below
        check_range(name, value, TRL_BATCH_DEFAULTS[name] or 1)
    share = per_device_train_batch_size * world_size  # the completions of one optimizer micro-step
    steps = _micro_steps(share, steps_per_generation, generation_batch_size, gradient_accumulation_steps)
    completions = share * steps
    if completions % num_generations:
        # each process's share whole groups: a per-device count that is a multiple of num_generations
        fit = num_generations * math.ceil(per_device_train_batch_size / num_generations)
        raise TrlValueError(
            f"a rollout batch of {completions} completions (per_device_train_batch_size x processes x "
            f"steps_per_generation) does not hold whole groups of num_generations={num_generations}",
            {"per_device_train_batch_size": fit, "num_generations": num_generations},
        )
    if steps % gradient_accumulation_steps:
        raise TrlValueError(
            f"steps_per_generation={steps} is not a multiple of gradient_accumulation_steps="
            f"{gradient_accumulation_steps}, the micro-steps of each optimizer update",
            {
                "steps_per_generation": max(1, steps // gradient_accumulation_steps)
                * gradient_accumulation_steps,
                "gradient_accumulation_steps": gradient_accumulation_steps,
            },
        )
    if num_iterations != 1:
        raise TrlValueError(
            f"num_iterations={num_iterations}: gspo makes one pass over a rollout batch, in train.minibatches "
            "updates on shares of it (the GSPO paper's 4 minibatches); for that many off-policy updates per "
            "rollout batch, split it",
            {"num_iterations": 1, "steps_per_generation": num_iterations * steps},
        )
    return {
        "rollout.prompts_per_step": completions // num_generations,
        "rollout.group_size": num_generations,
        "train.minibatches": steps // gradient_accumulation_steps,
    }


# ---- each TRL name -------------------------------------------------------------------------------------


def _level(value: str) -> Translation:
    return Translation(loss_keys("grpo", value), "with loss_type='grpo', TRL's GSPO recipe")


def _loss_type(value: str) -> Translation:
    level = "token" if (value, "token") in TRL_LOSSES else "sequence"  # TRL's default level where it has it
    return Translation(loss_keys(value, level), f"at importance_sampling_level={level!r}")


def _epsilon(value: float) -> Translation:
    return Translation(
        {"train.eps_low": value, "train.eps_high": value}, "both sides, as TRL's epsilon alone"
    )


def _scale_rewards(value: Any) -> Translation:
    scale = (
        {"group": "group", "batch": "batch", "none": "none"}.get(value) if isinstance(value, str) else None
    )
    if isinstance(value, bool):
        scale = "group" if value else "none"
    if scale is None:
        raise TrlValueError(
            f"scale_rewards={shown(value)} is not 'group', 'batch', 'none', True or False",
            {"scale_rewards": "group"},
        )
    return Translation({"train.advantage_scale": scale})


def _bf16(value: bool | None) -> Translation:
    if value is None:
        return Translation({"train.mixed_precision": "auto"}, "bf16 on a CUDA GPU, fp32 on a CPU")
    return Translation({"train.mixed_precision": "bf16" if value else "none"})


def _use_vllm(value: bool) -> Translation:
    return Translation({"rollout.engine": "vllm" if value else "hf"}, "vLLM in the trainer's process")


def _vllm_mode(value: str) -> Translation:
    if value == "colocate":
        return Translation({"rollout.engine": "vllm"}, "with use_vllm=True")
    raise TrlValueError(
        f"vllm_mode={value!r}: gspo does not talk to `trl vllm-serve`; it starts a `vllm serve` of its own, or "
        "uses yours by URL (docs/vllm.md)",
        {"gspo": {"rollout": {"engine": "vllm_server"}}},
    )


def _schedule(value: str) -> Translation:
    schedule = "constant" if value == "constant_with_warmup" else value  # gspo's constant has the warm-up
    if schedule not in ("constant", "cosine", "linear"):
        raise TrlValueError(
            f"lr_scheduler_type={value!r} is not one gspo has ('linear', TRL's default, 'cosine' or 'constant', "
            "each after warmup_steps of linear warm-up)",
            {"lr_scheduler_type": "cosine"},
        )
    return Translation({"train.schedule": schedule})


def _max_steps(value: int) -> Translation:
    return Translation(
        {"train.steps": value, "train.minibatches": 1},
        "TRL counts optimizer updates, gspo rollout batches of train.minibatches updates: one each here",
    )


def _epochs(value: float) -> Translation:
    steps = max(1, math.ceil(value * 60 / 8))  # the default task's 60 training problems, 8 prompts a batch
    return Translation(
        {"train.steps": steps},
        "gspo counts rollout batches: epochs x training rows / rollout.prompts_per_step",
    )


def _save_only_model(value: bool) -> Translation:
    return Translation(
        {"checkpoint.optimizer": not value}, "a checkpoint without AdamW's state resumes, but not exactly"
    )


def _reward_weights(value: Any) -> Translation:
    if not isinstance(value, (list, tuple)) or not value:
        raise TrlValueError(
            f"reward_weights={shown(value)} is not a list of numbers, one per reward function",
            {"reward_weights": [1.0]},
        )
    names = ["exact_answer", "correct_number", "number_format", "digit_fraction", "reasoning_gym"]
    return Translation(
        {"rewards": dict(zip(names, value, strict=False))},
        "gspo weighs each reward by its name, a built-in's or your function's; the built-ins here",
    )


def _sapo_temperature(key: str) -> Callable[[Any], Translation]:
    """SAPO's gate temperature: TRL's loss_type='sapo' reads it (at the token level: gspo's sapo)."""
    return lambda value: Translation({"train.objective": "sapo", key: value}, "with loss_type='sapo'")


def _batch_name(name: str) -> Callable[[Any], Translation]:
    """A batch name alone: the shape with TRL's defaults for the others."""

    def translate(value: Any) -> Translation:
        return Translation(batch_shape(**{**TRL_BATCH_DEFAULTS, name: value}), "TRL's defaults for the rest")

    return translate


def _save_strategy(value: Any) -> Translation:
    if value == "steps":
        return Translation({}, "a checkpoint every save_steps optimizer updates")
    if value == "no":
        return Translation(
            {"checkpoint.every": 0}, "gspo still saves the last step, which a resume starts from"
        )
    raise TrlValueError(
        f"save_strategy={shown(value)}: gspo saves every save_steps optimizer updates ('steps') or at the "
        "end alone ('no')",
        {"save_strategy": "steps", "save_steps": 100},
    )


def _eval_strategy(value: Any) -> Translation:
    if value == "no":
        return Translation(
            {"eval.every": 0}, "gspo still evaluates before and after training, on rows held out"
        )
    if value == "steps":
        return Translation(
            {}, "every eval_steps optimizer updates, on eval_dataset's rows (gspo's eval.every)"
        )
    raise TrlValueError(
        f"eval_strategy={shown(value)}: gspo evaluates every eval_steps optimizer updates ('steps'), or before "
        "and after training alone ('no')",
        {"eval_strategy": "steps", "eval_steps": 100},
    )


SAMPLING_KEYS = {
    "temperature": "rollout.temperature",
    "top_p": "rollout.top_p",
    "max_new_tokens": "rollout.max_new_tokens",  # transformers' GenerationConfig
    "max_tokens": "rollout.max_new_tokens",  # vLLM's SamplingParams
}
"""generation_kwargs' keys that gspo's samplers draw with (gspo.rollout.requests.SamplingParams)."""


def _generation_kwargs(value: Any) -> Translation:
    """TRL's generation_kwargs, which TRL applies over temperature, top_p and max_completion_length: the
    keys gspo's samplers have; any other is refused by name."""
    if value is None:
        return Translation({})
    if not isinstance(value, Mapping):
        raise TrlValueError(
            f"generation_kwargs={shown(value)} is not a dict", {"generation_kwargs": {"temperature": 0.9}}
        )
    others = [key for key in value if key not in SAMPLING_KEYS]
    if others:
        raise TrlValueError(
            f"generation_kwargs holds {', '.join(map(repr, others))}: gspo's samplers draw with temperature, "
            f"top_p and a length alone ({', '.join(SAMPLING_KEYS)})",
            {"generation_kwargs": {k: v for k, v in value.items() if k in SAMPLING_KEYS}},
        )
    keys = {SAMPLING_KEYS[key]: item for key, item in value.items()}
    if "rollout.max_new_tokens" in keys:  # as max_completion_length: the evaluation's length too
        keys["eval.max_new_tokens"] = keys["rollout.max_new_tokens"]
    return Translation(keys, "over temperature, top_p and max_completion_length, as TRL applies them")


MODEL_INIT_KEYS = {
    "torch_dtype": "model.dtype",
    "dtype": "model.dtype",
    "attn_implementation": "model.attn_implementation",
}
"""model_init_kwargs' keys that gspo's model loading has."""


def _model_init_kwargs(value: Any) -> Translation:
    if not value:
        return Translation({})
    if not isinstance(value, Mapping):
        raise TrlValueError(
            f"model_init_kwargs={shown(value)} is not a dict", {"model_init_kwargs": {"dtype": "bfloat16"}}
        )
    others = [key for key in value if key not in MODEL_INIT_KEYS]
    if others:
        raise TrlValueError(
            f"model_init_kwargs holds {', '.join(map(repr, others))}: gspo loads the model with a dtype and an "
            "attention implementation alone",
            {"model_init_kwargs": {k: v for k, v in value.items() if k in MODEL_INIT_KEYS}},
        )
    # a torch.dtype as its name: torch.bfloat16 -> "bfloat16"
    return Translation({MODEL_INIT_KEYS[k]: str(v).removeprefix("torch.") for k, v in value.items()})


def _optim(value: Any) -> Translation:
    if value in ("adamw_torch", "adamw_torch_fused"):
        return Translation({}, "gspo's AdamW is torch's, fused")
    raise TrlValueError(f"optim={shown(value)}: gspo trains with torch's AdamW", {"optim": "adamw_torch"})


def _disable_tqdm(value: bool | None) -> Translation:
    if value is None:
        return Translation({}, "a progress bar on a terminal, a line per rollout batch elsewhere")
    return Translation({"progress": not value})


def _find_unused(value: bool | None) -> Translation:
    return Translation({} if value is None else {"distributed.find_unused_parameters": value})


def _adaptive_entropy(value: bool) -> Translation:
    if not value:
        return Translation({}, "a fixed entropy_coef")
    return Translation({"train.entropy_target": 0.2}, "TRL's entropy_target, 0.2, unless it is given")


def _entropy_target(value: float) -> Translation:
    return Translation({"train.entropy_target": value}, "with use_adaptive_entropy=True, as TRL reads it")


def _ignored(why: str) -> Callable[[Any], Translation]:
    """A TRL name that changes nothing in gspo, whatever its value."""
    return lambda value: Translation({}, why)


RENAMED: dict[str, str] = {
    "learning_rate": "train.lr",
    "num_generations": "rollout.group_size",
    "max_completion_length": "rollout.max_new_tokens",
    "beta": "train.beta",
    "epsilon_high": "train.eps_high",
    "temperature": "rollout.temperature",
    "top_p": "rollout.top_p",
    "mask_truncated_completions": "rollout.mask_truncated",
    "weight_decay": "train.weight_decay",
    "max_grad_norm": "train.max_grad_norm",
    "warmup_steps": "train.warmup_updates",
    "save_steps": "checkpoint.every",
    "save_total_limit": "checkpoint.keep",
    "eval_steps": "eval.every",
    "per_device_eval_batch_size": "eval.batch_size",
    "off_policy_mask_threshold": "train.opsm_delta",
    "model_name_or_path": "model.path",
    "entropy_coef": "train.entropy_coef",
    "entropy_coef_max": "train.entropy_coef_max",
    "entropy_coef_delta": "train.entropy_coef_delta",
}
"""TRL's names of keys gspo has under another name, with the same value."""

TRANSLATED: dict[str, Callable[[Any], Translation]] = {
    "importance_sampling_level": _level,
    "loss_type": _loss_type,
    "epsilon": _epsilon,
    "scale_rewards": _scale_rewards,
    "bf16": _bf16,
    "use_vllm": _use_vllm,
    "vllm_mode": _vllm_mode,
    "lr_scheduler_type": _schedule,
    "max_steps": _max_steps,
    "num_train_epochs": _epochs,
    "save_only_model": _save_only_model,
    "reward_weights": _reward_weights,
    "sapo_temperature_pos": _sapo_temperature("train.tau_pos"),
    "sapo_temperature_neg": _sapo_temperature("train.tau_neg"),
    **{name: _batch_name(name) for name in TRL_BATCH_DEFAULTS if name != "num_generations"},
    "save_strategy": _save_strategy,
    "eval_strategy": _eval_strategy,
    "generation_kwargs": _generation_kwargs,
    "model_init_kwargs": _model_init_kwargs,
    "optim": _optim,
    "disable_tqdm": _disable_tqdm,
    "ddp_find_unused_parameters": _find_unused,
    "use_adaptive_entropy": _adaptive_entropy,
    "entropy_target": _entropy_target,
    "logging_steps": _ignored("gspo logs every rollout batch, to metrics.jsonl and report_to's trackers"),
    "logging_strategy": _ignored("gspo logs every rollout batch, to metrics.jsonl and report_to's trackers"),
    "logging_first_step": _ignored("gspo logs every rollout batch, the first too"),
    "logging_dir": _ignored("report_to's trackers write into the run folder"),
    "run_name": _ignored("report_to's trackers name each run after its folder"),
    "gradient_checkpointing": _ignored("train.micro_batch_tokens bounds the memory of a pass"),
    "gradient_checkpointing_kwargs": _ignored("train.micro_batch_tokens bounds the memory of a pass"),
    "log_completions": _ignored("completions.jsonl and report_to's tables keep completions always"),
    "num_completions_to_print": _ignored("completions.jsonl keeps each rollout batch's completions"),
    "max_prompt_length": _ignored(
        "gspo keeps every prompt whole, and refuses at start-up one that does not fit the model's context with "
        "its completion"
    ),
    "remove_unused_columns": _ignored("every column but the prompt reaches the reward functions, as in TRL"),
    "dataloader_num_workers": _ignored("gspo draws its prompts from rows in memory"),
    "disable_dropout": _ignored(
        "gspo trains with dropout off (the model in eval mode), as disable_dropout=True"
    ),
    "cast_lm_head_to_fp32": _ignored("gspo computes the log-softmax over the vocabulary in fp32 always"),
    "do_eval": _ignored("gspo evaluates whenever it holds rows out (eval_dataset)"),
    "hub_model_id": _ignored("it names the upload of push_to_hub, which gspo does not do"),
}
"""TRL's names whose value becomes other values, or several keys, in gspo (or none: ignored, and why)."""

_VLLM_SERVER = {"gspo": {"rollout": {"engine": "vllm_server"}}}
_AGENTS = "gspo trains tool-using agents through `gspo serve` and your agent's own loop (docs/agents.md)"

LACKING: dict[str, tuple[Any, str, dict[str, Any]]] = {
    "top_k": (0, "gspo samples with temperature and top_p alone", {"top_p": 0.9}),
    "min_p": (None, "gspo samples with temperature and top_p alone", {"top_p": 0.9}),
    "repetition_penalty": (1.0, "a penalty changes the distribution the trainer scores", {}),
    "chat_template_kwargs": (
        None,
        "gspo applies the model's chat template with its defaults; a system message goes in task.system_prompt",
        {},
    ),
    "fp16": (False, "gspo computes in bf16 or fp32", {"bf16": True}),
    "delta": (None, "gspo clips as the papers do, one bound per sign of the advantage", {}),
    "num_generations_eval": (None, "evaluation is greedy, one completion per held-out problem", {}),
    "top_entropy_quantile": (1.0, "gspo trains every completion token", {}),
    "entropy_coef_min": (0.0, "gspo's adaptive coefficient stays within [0, entropy_coef_max]", {}),
    "sync_ref_model": (False, "gspo's reference (beta > 0) is the initial policy", {}),
    "multi_objective_aggregation": (
        "sum_then_normalize",
        "gspo sums the weighted rewards, then normalises them, TRL's default",
        {},
    ),
    "use_liger_kernel": (False, "gspo computes its log-probs in chunks of its own", {}),
    "warmup_ratio": (
        None,
        "below 1, warmup_steps is a share of the updates, as TRL reads it",
        {"warmup_steps": 0.1},
    ),
    "vllm_server_base_url": (
        None,
        "gspo does not talk to `trl vllm-serve`; it starts a `vllm serve` of its own, or uses yours",
        _VLLM_SERVER,
    ),
    "vllm_gpu_memory_utilization": (
        0.3,
        "gspo sizes vLLM's key/value cache in GiB (rollout.vllm.kv_cache_gib)",
        {"gspo": {"rollout": {"vllm": {"kv_cache_gib": 8.0}}}},
    ),
    "vllm_tensor_parallel_size": (1, "gspo's vLLM engine runs on the trainer's own device", {}),
    "use_transformers_continuous_batching": (False, "gspo's own engine refills its slots as samples end", {}),
    "vllm_importance_sampling_correction": (
        True,
        "gspo corrects the sampler's mismatch with train.sampler_correction",
        {"gspo": {"train": {"sampler_correction": "auto"}}},
    ),
    "adam_epsilon": (1e-8, "gspo's AdamW keeps torch's eps, 1e-8", {}),
    "lr_scheduler_kwargs": (None, "gspo's schedules take no arguments but warmup_steps", {}),
    "torch_compile": (False, "gspo runs the model as transformers builds it", {}),
    "deepspeed": (
        None,
        "under torchrun gspo shards with FSDP2",
        {"gspo": {"distributed": {"wrapper": "fsdp2"}}},
    ),
    "fsdp": (None, "under torchrun gspo shards with FSDP2", {"gspo": {"distributed": {"wrapper": "fsdp2"}}}),
    "trust_remote_code": (False, "gspo loads models with transformers' own code alone", {}),
    "push_to_hub": (
        False,
        "gspo uploads nothing: trainer.save_model() writes a model folder, which `hf upload` sends",
        {},
    ),
    "overwrite_output_dir": (
        False,
        "gspo overwrites no run: continue it with trainer.train(resume_from_checkpoint=True), or choose "
        "another output_dir",
        {},
    ),
    "resume_from_checkpoint": (
        None,
        "gspo takes it where TRL's trainer does: trainer.train(resume_from_checkpoint=...)",
        {},
    ),
    "load_best_model_at_end": (False, "gspo keeps the latest checkpoints (save_total_limit)", {}),
    "shuffle_dataset": (True, "gspo draws the prompts in an order its seed shuffles", {}),
    "data_seed": (None, "gspo's prompt order follows seed", {}),
    "save_safetensors": (True, "gspo saves safetensors always", {}),
    "tools": (None, _AGENTS, {}),
    "max_tool_calling_iterations": (None, _AGENTS, {}),
}
"""TRL's names of settings gspo does not have: TRL's default (taken: it changes nothing; where the
default is None, an empty value too), why, and GRPOConfig keywords to use instead (none: leave it out)."""

TRL_NAMES = frozenset(RENAMED) | frozenset(TRANSLATED) | frozenset(LACKING)
"""Every TRL name the table knows."""


def translate(name: str, value: Any) -> Translation:
    """gspo's keys and values for TRL's `name` = `value`; TrlValueError where gspo has no such value or
    setting, naming what to use instead. KeyError for a name that is not in `TRL_NAMES`."""
    if name in RENAMED:
        return Translation({RENAMED[name]: value})
    if name in TRANSLATED:
        return TRANSLATED[name](value)
    default, why, instead = LACKING[name]
    if value == default or (default is None and _empty(value)):
        return Translation({}, f"TRL's default; {why}")
    raise TrlValueError(f"{name}={shown(value)}: gspo has no such setting ({why})", instead)


def _empty(value: Any) -> bool:
    """An empty dict, list or string, or False: what a setting whose default is None holds unset."""
    return value is False or (isinstance(value, (Mapping, list, tuple, str)) and not value)


def nested(keys: dict[str, Any]) -> dict[str, Any]:
    """Dotted keys as `Config`'s keyword arguments: {"train.lr": 1e-5, "seed": 1} -> {"train": {"lr":
    1e-5}, "seed": 1}."""
    out: dict[str, Any] = {}
    for key, value in keys.items():
        *sections, leaf = key.split(".")
        node = out
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = value
    return out


def as_code(keys: dict[str, Any], *, python: bool) -> str:
    """Dotted keys as `Config(...)` (``python``) or as `gspo train` overrides (JSON's lists and strings
    are YAML's too)."""
    if python:
        return f"Config({', '.join(f'{name}={value!r}' for name, value in nested(keys).items())})"
    words = (f"{key}={value if isinstance(value, str) else json.dumps(value)}" for key, value in keys.items())
    return " ".join(map(shlex.quote, words))  # as a shell takes them: a mapping's spaces quoted


def trl_hint(name: str, value: Any, *, python: bool) -> str:
    """The message for TRL's `name` given to gspo's config: its gspo keys, the value translated, as
    `Config(...)` (``python``) or overrides; where gspo lacks it, what to use instead."""
    head = f"unknown config key {shown(name)}: TRL's {name}={shown(value)}"
    try:
        translation = translate(name, value)
    except TrlValueError as error:  # its fix in TRL's names, which gspo.trl's GRPOConfig takes
        return f"{head} has no gspo key: {error} (in gspo.trl's GRPOConfig)"
    note = f" ({translation.note})" if translation.note else ""
    if not translation.keys:
        return f"{head} has no gspo key{note}: leave it out (gspo.trl's GRPOConfig takes it and ignores it)"
    return f"{head} is gspo's {', '.join(translation.keys)}{note}: {as_code(translation.keys, python=python)}"
