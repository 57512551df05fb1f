"""TRL's GRPOConfig names in gspo's words: what each one is among gspo's keys, and what to use where gspo
has no such setting. One table, read by the config's hints (a TRL name given to `Config`, a YAML file or
an override) and by gspo.trl's GRPOConfig, which takes the names themselves.

`translate` takes a name and the value a TRL user writes and gives gspo's keys and values (dotted), or
raises `TrlValueError` whose ``instead`` names GRPOConfig keywords that work. Counts translate under TRL's
default batch shape (one optimizer update per rollout batch), where TRL's optimizer steps and gspo's
rollout batches agree.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Callable
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
    if steps_per_generation is not None and generation_batch_size is not None:
        raise TrlValueError(
            "generation_batch_size and steps_per_generation are both set (TRL refuses it too)",
            {"steps_per_generation": steps_per_generation},
        )
    share = per_device_train_batch_size * world_size  # the completions of one optimizer micro-step
    if generation_batch_size is not None:
        if generation_batch_size % share:
            raise TrlValueError(
                f"generation_batch_size={generation_batch_size} is not a multiple of per_device_train_batch_size"
                f" x processes = {share}",
                {"generation_batch_size": max(1, generation_batch_size // share) * share},
            )
        steps_per_generation = generation_batch_size // share
    steps = gradient_accumulation_steps if steps_per_generation is None else steps_per_generation
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
    "logging_steps": _ignored("gspo logs every rollout batch, to metrics.jsonl and report_to's trackers"),
    "gradient_checkpointing": _ignored("train.micro_batch_tokens bounds the memory of a pass"),
    "log_completions": _ignored("completions.jsonl and report_to's tables keep completions always"),
}
"""TRL's names whose value becomes other values, or several keys, in gspo."""

LACKING: dict[str, tuple[Any, str, dict[str, Any]]] = {
    "top_k": (0, "gspo samples with temperature and top_p alone", {"top_p": 0.9}),
    "min_p": (None, "gspo samples with temperature and top_p alone", {"top_p": 0.9}),
    "repetition_penalty": (1.0, "a penalty changes the distribution the trainer scores", {}),
    "fp16": (False, "gspo computes in bf16 or fp32", {"bf16": True}),
    "delta": (None, "gspo clips as the papers do, one bound per sign of the advantage", {}),
    "num_generations_eval": (None, "evaluation is greedy, one completion per held-out problem", {}),
    "top_entropy_quantile": (1.0, "gspo trains every completion token", {}),
    "entropy_coef": (0.0, "gspo has no entropy bonus", {}),
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
    "eval_strategy": (
        "no",
        "gspo evaluates greedily on rows of train_dataset it holds out, every eval.every steps",
        {"gspo": {"task": {"num_eval": 20}, "eval": {"every": 10}}},
    ),
    "do_eval": (
        False,
        "gspo evaluates on rows of train_dataset it holds out",
        {"gspo": {"task": {"num_eval": 20}}},
    ),
    "vllm_server_base_url": (
        None,
        "gspo does not talk to `trl vllm-serve`; it starts a `vllm serve` of its own, or uses yours",
        {"gspo": {"rollout": {"engine": "vllm_server"}}},
    ),
    "use_transformers_continuous_batching": (False, "gspo's own engine refills its slots as samples end", {}),
    "vllm_importance_sampling_correction": (
        True,
        "gspo corrects the sampler's mismatch with train.sampler_correction",
        {"gspo": {"train": {"sampler_correction": "auto"}}},
    ),
}
"""TRL's names of settings gspo does not have: TRL's default (taken: it changes nothing), why, and
GRPOConfig keywords to use instead (none: leave it out)."""

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
    if value == default:
        return Translation({}, f"TRL's default; {why}")
    raise TrlValueError(f"{name}={shown(value)}: gspo has no such setting ({why})", instead)


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
