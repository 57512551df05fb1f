"""Checks across fields that the type system cannot express; each error names the field and the fix."""

from __future__ import annotations

import importlib.util

from gspo.config.engines import check_engine
from gspo.config.rules import check_values
from gspo.config.schema import Config, ConfigError
from gspo.core.registry import PAPER_DEFAULTS, SEQUENCE_OBJECTIVES


def validate(config: Config) -> None:
    """Checks of a config on its own (``load_config`` runs them); ``validate_setup`` adds the run's.

    First each key's range (gspo.config.rules), then what relates several keys."""
    check_values(config)  # the objective's and the engine's names among them
    _check_objective(config)
    check_engine(config)
    samples = config.rollout.prompts_per_step * config.rollout.group_size
    if samples < config.train.minibatches:
        raise ConfigError(
            f"train.minibatches={config.train.minibatches} exceeds the "
            f"{samples} completions of a rollout batch (rollout.prompts_per_step x rollout.group_size)"
        )
    if config.task.name == "file" and not config.task.data_path:
        raise ConfigError("task.name=file needs task.data_path (a .jsonl, .csv or datasets directory)")
    if (config.task.name == "reasoning_gym") != (config.task.dataset is not None):
        raise ConfigError(
            "task.dataset names a reasoning-gym dataset and goes with task.name=reasoning_gym: set both "
            f"(e.g. task.name=reasoning_gym task.dataset=chain_sum); got task.name={config.task.name!r}, "
            f"task.dataset={config.task.dataset!r}"
        )
    if config.task.dataset_config and config.task.name != "reasoning_gym":
        raise ConfigError(
            f"task.dataset_config sets a reasoning-gym dataset, but task.name={config.task.name!r}: set "
            "task.name=reasoning_gym and task.dataset, or remove task.dataset_config"
        )
    if config.model.path is not None and config.model.tiny is not None:
        raise ConfigError("set either model.path or model.tiny, not both")
    if config.task.operand_min > config.task.operand_max:
        raise ConfigError(
            f"task.operand_min={config.task.operand_min} exceeds task.operand_max={config.task.operand_max}"
        )
    _check_corrections(config)
    _check_serve(config)
    _check_sequence_parallel(config)
    _check_skipping(config)
    _check_configured_rewards(config)
    if config.train.logprob_kernel == "triton" and importlib.util.find_spec("triton") is None:
        raise ConfigError(
            "train.logprob_kernel=triton needs triton (`pip install triton`; CUDA builds of torch bring it): "
            "install it or set train.logprob_kernel=auto"
        )


def _check_objective(config: Config) -> None:
    """Each built-in objective's knobs: a clip range, or SAPO's temperatures (their ranges, and the
    objective's name: gspo.config.rules). A user objective's knobs are checked when it is loaded."""
    train = config.train
    if ":" in train.objective:  # "module:function" or "path/file.py:function"
        return
    sapo = "tau_pos" in PAPER_DEFAULTS[train.objective]  # a soft gate, not a clip range
    for name in ("eps_low", "eps_high", "tau_pos", "tau_neg"):
        value = getattr(train, name)
        if value is None:
            continue
        if name.startswith("eps") and sapo:
            raise ConfigError(
                f"train.{name} is a clip range, but train.objective={train.objective} has a soft gate instead: "
                "unset it, or tune train.tau_pos / train.tau_neg"
            )
        if name.startswith("tau") and not sapo:
            raise ConfigError(
                f"train.{name} is SAPO's gate temperature; train.objective={train.objective} does not use it "
                "(set train.objective=sapo or sapo_seq, or unset it)"
            )
    # the ratio's lower bound is 1 - eps_low; GMPO clips log r (any eps_low), CISPO's weight may reach 0
    limit = {"gmpo": float("inf"), "cispo": 1.0}.get(train.objective)
    if train.eps_low is not None and limit is None and train.eps_low >= 1:
        raise ConfigError(
            f"train.eps_low must be < 1 (the ratio's lower bound is 1 - eps_low), got {train.eps_low}"
        )
    if train.eps_low is not None and limit == 1.0 and train.eps_low > 1:
        raise ConfigError("train.eps_low must be <= 1 for cispo (its weight's lower bound is 1 - eps_low)")


def _check_corrections(config: Config) -> None:
    """The train-inference mismatch corrections: recompute, a level the objective has, ordered bounds."""
    train = config.train
    correction = train.sampler_correction
    if correction == "auto":  # resolved per step (gspo.learning.policy.update_choices), always a valid choice
        return
    if correction != "none" and train.old_logprobs == "sampler":
        raise ConfigError(
            f"train.sampler_correction={correction} corrects sampler -> old policy and needs "
            "train.old_logprobs=recompute (with old_logprobs=sampler the ratio itself already divides by the "
            "sampler's probabilities)"
        )
    if correction.startswith("token") and train.objective in SEQUENCE_OBJECTIVES:
        raise ConfigError(
            f"train.sampler_correction={correction} weighs tokens, but train.objective={train.objective} has one "
            f"term per sequence: use train.sampler_correction={correction.replace('token', 'sequence')} (the "
            "length-normalised sequence ratio)"
        )
    low, high = train.sampler_correction_min, train.sampler_correction_max
    if correction == "none" and (low is not None or high is not None):
        raise ConfigError(
            "train.sampler_correction_min / _max bound a correction: set train.sampler_correction too"
        )
    if low is not None and high is not None and low > high:
        raise ConfigError(f"train.sampler_correction_min={low} exceeds train.sampler_correction_max={high}")


LOOPBACK = ("127.0.0.1", "::1", "localhost")
"""Host names that only this machine reaches: `gspo serve` may listen there without an API key."""


def _check_configured_rewards(config: Config) -> None:
    """The reward model and the judge, where `rewards` names them, with what they need."""
    if "reward_model" in config.rewards and config.reward_model.path is None:
        raise ConfigError(
            "rewards names reward_model: set reward_model.path, a sequence-classification model folder"
        )
    if "judge" in config.rewards and (config.judge.url is None or config.judge.template is None):
        missing = " and ".join(key for key in ("url", "template") if getattr(config.judge, key) is None)
        raise ConfigError(
            f"rewards names judge: set judge.{missing.replace(' and ', ' and judge.')} (the server's API root, "
            'e.g. "http://127.0.0.1:8000/v1", and a prompt template file with $prompt and $completions)'
        )


def _check_skipping(config: Config) -> None:
    """train.skip_zero_advantage=true only where skipping is exact: no term depends on every sample."""
    train = config.train
    if train.skip_zero_advantage is not True:
        return
    if train.beta > 0:
        raise ConfigError(
            f"train.skip_zero_advantage=true with train.beta={train.beta}: the KL term depends on every "
            "sample, so skipping the zero-advantage ones would change the loss; set it to auto (off with a "
            "KL term) or false"
        )
    if train.entropy_coef != 0 or train.entropy_target is not None:
        raise ConfigError(
            "train.skip_zero_advantage=true with an entropy bonus (train.entropy_coef, train.entropy_target): "
            "the bonus depends on every sample, so skipping the zero-advantage ones would change the loss; "
            "set it to auto (off with an entropy bonus) or false"
        )


def _check_sequence_parallel(config: Config) -> None:
    """What a row split across ranks supports: packed rows, and losses whose per-sequence sums are all-reduced
    (gspo.core.objectives' segment_sum_reduce)."""
    size, train = config.distributed.sequence_parallel, config.train
    if size == 1:
        return
    key = f"distributed.sequence_parallel={size}"
    if train.layout not in ("auto", "packed"):
        raise ConfigError(f"{key} splits packed rows: set train.layout=packed (or auto), not {train.layout}")
    if train.objective == "gmpo":
        raise ConfigError(
            f"{key} does not support train.objective=gmpo (its per-sequence mean of clipped token log-ratios "
            "is not a sum over the ranks): use gspo or gspo_token, or set distributed.sequence_parallel=1"
        )
    if train.sampler_correction not in ("none", "auto") or train.opsm_delta is not None:
        raise ConfigError(
            f"{key} does not support the mismatch corrections (train.sampler_correction, train.opsm_delta): "
            "set them off, or set distributed.sequence_parallel=1"
        )
    if config.rollout.lag > 0:
        raise ConfigError(
            f"{key} does not support rollout.lag={config.rollout.lag} (the decoupled objective's correction "
            "needs whole rows): set rollout.lag=0, or distributed.sequence_parallel=1"
        )
    if train.routing_replay:
        raise ConfigError(
            f"{key} does not support train.routing_replay (the old policy's expert choices are recorded per "
            "whole row): set train.routing_replay=false, or distributed.sequence_parallel=1"
        )
    if train.entropy_coef != 0 or train.entropy_target is not None:
        raise ConfigError(
            f"{key} does not support the entropy bonus (train.entropy_coef, train.entropy_target: the entropy "
            "is computed per whole row): set train.entropy_coef=0 and train.entropy_target=null, or "
            "distributed.sequence_parallel=1"
        )


def _check_serve(config: Config) -> None:
    """A reachable address has a key (the ranges of `serve.*`: gspo.config.rules)."""
    serve = config.serve
    if serve.host not in LOOPBACK and serve.api_key_env is None:
        raise ConfigError(
            f"serve.host={serve.host} lets other machines connect: set serve.api_key_env to the variable "
            "holding the API key clients must send, or listen on serve.host=127.0.0.1"
        )


def validate_setup(config: Config, *, num_processes: int, is_moe: bool) -> None:
    """Checks that depend on the launch (torchrun's WORLD_SIZE) and on the model loaded."""
    if config.train.routing_replay and not is_moe:
        raise ConfigError(
            "train.routing_replay needs a Mixture-of-Experts model with top-k routers (e.g. Qwen3-MoE); "
            "this model has none"
        )
    validate_launch(config, num_processes=num_processes)


def validate_launch(config: Config, *, num_processes: int) -> None:
    """Checks that depend on the launch alone (torchrun's WORLD_SIZE), not on the model: a run refused by
    them is refused before its folder is claimed (gspo.run.start.open_folder), so it writes nothing."""
    size = config.distributed.sequence_parallel
    if num_processes % size:
        raise ConfigError(
            f"distributed.sequence_parallel={size} does not divide the {num_processes} processes: launch a "
            f"multiple of {size} processes, or set distributed.sequence_parallel to a divisor of {num_processes}"
        )
    if num_processes <= 1:
        return
    prompts = config.rollout.prompts_per_step
    if prompts % num_processes:
        up = -(-prompts // num_processes) * num_processes
        raise ConfigError(
            f"rollout.prompts_per_step={prompts} does not divide across {num_processes} processes (each "
            f"generates whole groups for an equal share of the prompts): set rollout.prompts_per_step={up} "
            f"(a multiple of {num_processes}), or launch a number of processes that divides {prompts}"
        )
    if config.distributed.wrapper == "fsdp2" and config.lora.rank > 0:
        raise ConfigError(
            "lora.rank > 0 with distributed.wrapper=fsdp2 is not supported: use distributed.wrapper=ddp "
            "(the adapters' gradients and optimizer state are small enough to replicate)"
        )
    if config.distributed.wrapper == "fsdp2" and config.rollout.lag > 0:
        raise ConfigError(
            f"rollout.lag={config.rollout.lag} keeps a copy of the whole model per rank to sample from, and "
            "distributed.wrapper=fsdp2 shards it: set distributed.wrapper=ddp, or rollout.lag=0"
        )
