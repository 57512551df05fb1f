"""Checks across fields that the type system cannot express; each error names the field and the fix."""

from __future__ import annotations

import importlib.util
import re

from gspo.config.schema import Config, ConfigError
from gspo.core.registry import PAPER_DEFAULTS, SEQUENCE_OBJECTIVES


def validate(config: Config) -> None:
    """Checks of a config on its own (``load_config`` runs them); ``validate_setup`` adds the run's."""
    positive = {
        "rollout.prompts_per_step": config.rollout.prompts_per_step,
        "rollout.group_size": config.rollout.group_size,
        "rollout.max_new_tokens": config.rollout.max_new_tokens,
        "train.steps": config.train.steps,
        "train.minibatches": config.train.minibatches,
        "train.micro_batch_tokens": config.train.micro_batch_tokens,
        "train.pack_length": config.train.pack_length,
        "train.logprob_chunk_size": config.train.logprob_chunk_size,
        "eval.max_new_tokens": config.eval.max_new_tokens,
        "eval.batch_size": config.eval.batch_size,
        "checkpoint.keep": config.checkpoint.keep,
        "rollout.generation_batch_size": config.rollout.generation_batch_size,
        "rollout.openai.concurrency": config.rollout.openai.concurrency,
        "rollout.llama_cpp.sync_every": config.rollout.llama_cpp.sync_every,
    }
    for name, value in positive.items():
        if value < 1:
            raise ConfigError(f"{name} must be at least 1, got {value}")
    if config.rollout.group_size < 2:
        raise ConfigError(
            f"rollout.group_size must be at least 2, got {config.rollout.group_size}: advantages compare "
            "each completion with the others of its prompt's group, so with one every advantage is 0 and "
            "nothing is learned"
        )
    if config.reward_timeout < 0 or config.train.warn_after_flat_steps < 0:
        raise ConfigError("reward_timeout and train.warn_after_flat_steps must be >= 0 (0: off)")
    if config.rollout.temperature <= 0:
        raise ConfigError(f"rollout.temperature must be > 0, got {config.rollout.temperature}")
    if not 0 < config.rollout.top_p <= 1:
        raise ConfigError(f"rollout.top_p must be in (0, 1], got {config.rollout.top_p}")
    if config.train.lr <= 0:
        raise ConfigError(f"train.lr must be > 0, got {config.train.lr}")
    _check_objective(config)
    samples = config.rollout.prompts_per_step * config.rollout.group_size
    if samples < config.train.minibatches:
        raise ConfigError(
            f"train.minibatches={config.train.minibatches} exceeds the "
            f"{samples} completions of a rollout batch (rollout.prompts_per_step x rollout.group_size)"
        )
    if len(config.train.adam_betas) != 2:
        raise ConfigError(f"train.adam_betas needs two numbers, got {config.train.adam_betas}")
    if not config.rewards:
        raise ConfigError(
            "rewards is empty: name at least one reward function, e.g. rewards={exact_answer: 1.0}"
        )
    if config.task.name == "file" and not config.task.data_path:
        raise ConfigError("task.name=file needs task.data_path (a .jsonl, .csv or datasets directory)")
    if config.model.path is not None and config.model.tiny is not None:
        raise ConfigError("set either model.path or model.tiny, not both")
    if config.eval.every < 0 or config.checkpoint.every < 0:
        raise ConfigError("eval.every and checkpoint.every must be >= 0")
    _check_corrections(config)
    if config.distributed.timeout_minutes <= 0:
        raise ConfigError(
            f"distributed.timeout_minutes must be > 0, got {config.distributed.timeout_minutes}"
        )
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", config.device):
        raise ConfigError(f'device must be "auto", "cpu", "cuda" or "cuda:N", got {config.device!r}')
    if config.train.logprob_kernel == "triton" and importlib.util.find_spec("triton") is None:
        raise ConfigError(
            "train.logprob_kernel=triton needs triton (`pip install triton`; CUDA builds of torch bring it): "
            "install it or set train.logprob_kernel=auto"
        )
    if config.rollout.engine == "openai" and not config.rollout.openai.url:
        raise ConfigError(
            'rollout.engine=openai needs rollout.openai.url, the API root (e.g. "http://127.0.0.1:8000/v1")'
        )
    url = config.rollout.openai.url
    if url is not None and not re.match(r"https?://[^/@\s]+(/|$)", url):
        raise ConfigError(
            f"rollout.openai.url={url!r}: give an http:// or https:// address without credentials in it "
            '(e.g. "http://127.0.0.1:8000/v1"; the API key goes in the variable rollout.openai.api_key_env)'
        )
    if config.rollout.engine in ("openai", "llama_cpp") and config.rollout.temperature != 1.0:
        raise ConfigError(
            f"rollout.temperature={config.rollout.temperature} with rollout.engine={config.rollout.engine}: servers report "
            "log-probs of the untempered distribution; sample at rollout.temperature=1.0"
        )


def _check_objective(config: Config) -> None:
    """Each objective's knobs: a clip range, or SAPO's temperatures; in range."""
    train = config.train
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
        if name.startswith("tau") and not value > 0:
            raise ConfigError(f"train.{name} must be > 0, got {value}")
        if not value >= 0:
            raise ConfigError(f"train.{name} must be >= 0, got {value}")
    # the ratio's lower bound is 1 - eps_low; GMPO clips log r (any eps_low), CISPO's weight may reach 0
    limit = {"gmpo": float("inf"), "cispo": 1.0}.get(train.objective)
    if train.eps_low is not None and limit is None and train.eps_low >= 1:
        raise ConfigError(
            f"train.eps_low must be < 1 (the ratio's lower bound is 1 - eps_low), got {train.eps_low}"
        )
    if train.eps_low is not None and limit == 1.0 and train.eps_low > 1:
        raise ConfigError("train.eps_low must be <= 1 for cispo (its weight's lower bound is 1 - eps_low)")


def _check_corrections(config: Config) -> None:
    """The train-inference mismatch corrections: recompute, a level the objective has, sane bounds."""
    train = config.train
    correction = train.sampler_correction
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
    if (low is not None and low < 0) or (high is not None and high <= 0):
        raise ConfigError(f"train.sampler_correction_min must be >= 0 and _max > 0, got {low} and {high}")
    if low is not None and high is not None and low > high:
        raise ConfigError(f"train.sampler_correction_min={low} exceeds train.sampler_correction_max={high}")
    if train.opsm_delta is not None and not train.opsm_delta >= 0:
        raise ConfigError(f"train.opsm_delta must be >= 0 (None disables), got {train.opsm_delta}")


def validate_setup(config: Config, *, num_processes: int, is_moe: bool) -> None:
    """Checks that depend on the launch (torchrun's WORLD_SIZE) and on the model loaded."""
    if config.train.routing_replay and not is_moe:
        raise ConfigError(
            "train.routing_replay needs a Mixture-of-Experts model with top-k routers (e.g. Qwen3-MoE); "
            "this model has none"
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
