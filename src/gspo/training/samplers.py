"""The samplers of `gspo train`, by rollout.engine: a registry of factories, each `(config, policy, tokenizer,
run_dir) -> Sampler`; a user's own factory is named as "path/file.py:function" (or "module:function"), under
the trust rules of reward code (gspo.run.trust)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gspo.config import Config, ConfigError
from gspo.learning.policy import Policy
from gspo.parallel.group import world_size
from gspo.rollout.llama_cpp import GGUFReload, LlamaCppServer, export_policy, require_llama_cpp
from gspo.rollout.openai import OpenAIBackend, WeightSync, api_key_problem
from gspo.rollout.samplers import CheckedSampler, HFSampler, Sampler
from gspo.rollout.user_code import CodeFileError, load_function, raised, raised_where
from gspo.rollout.vllm_engine import VLLMSampler, require_vllm
from gspo.rollout.vllm_server import ExternalVLLMServer, FileReload, VLLMServer, server_sampler
from gspo.run.build import generating, source_gguf
from gspo.run.paths import run_path

SamplerFactory = Callable[[Config, Policy, Any, Path], Sampler]
"""A sampler's factory: (config, policy, tokenizer, run folder) -> `gspo.rollout.samplers.Sampler`."""


def hf_sampler(config: Config, policy: Policy, tokenizer: Any, run_dir: Path) -> Sampler:
    """rollout.engine=hf: the trainer's own model, in this process (gspo.rollout.engine)."""
    return HFSampler(
        policy.model, tokenizer, config.rollout.generation_batch_size, lambda: generating(policy)
    )


def llama_cpp_sampler(config: Config, policy: Policy, tokenizer: Any, run_dir: Path) -> Sampler:
    """rollout.engine=llama_cpp: a llama.cpp server of ours, given the policy as GGUF files."""
    require_llama_cpp()  # before the export: its absence is known at once
    server = config.rollout.llama_cpp
    if world_size() > 1:
        raise ConfigError(
            "rollout.engine=llama_cpp runs in one process: use rollout.engine=hf under torchrun"
        )
    source, directory = source_gguf(config.model), run_path(run_dir, "llama_cpp")
    first = export_policy(policy.model, tokenizer, directory / "policy.gguf", server.gguf_quant, source)
    llama = LlamaCppServer(first, threads=torch.get_num_threads(), startup_timeout=server.timeout)
    sync = GGUFReload(llama, directory, every=server.sync_every, quant=server.gguf_quant, source=source)
    # llama-cpp-python reports a sampled control token as "": drawn again rather than ending the run
    return OpenAIBackend(
        llama.url,
        tokenizer,
        max_concurrency=1,
        timeout=server.timeout,
        weight_sync=sync,
        misaligned="resample",
    )


def openai_sampler(config: Config, policy: Policy, tokenizer: Any, run_dir: Path) -> Sampler:
    """rollout.engine=openai: an OpenAI-compatible server with weights of its own (never synced)."""
    server = config.rollout.openai
    warnings.warn(
        f"rollout.engine=openai: {server.url} samples from its own weights, which gspo train does not update; "
        "its rollouts drift off-policy as training goes on, and the old-policy log-probs are recomputed "
        "(pass Trainer(sampler=OpenAIBackend(..., weight_sync=...)) from Python to sync them)",
        stacklevel=2,
    )
    key = os.environ.get(server.api_key_env) or None
    if key is not None and (why := api_key_problem(key)):  # never echoed: it is a secret
        raise ConfigError(
            f"the environment variable {server.api_key_env} (rollout.openai.api_key_env) {why}; it is not "
            "shown: set it to the key alone, without a trailing newline or carriage return"
        )
    return OpenAIBackend(
        server.url,
        tokenizer,
        model=server.model,
        max_concurrency=server.concurrency,
        timeout=server.timeout,
        send_token_ids=server.token_ids,
        api_key=key,
    )


def vllm_dtype(config: Config) -> torch.dtype | None:
    """rollout.vllm.dtype as vLLM's compute dtype; None ("auto"): the policy's."""
    dtype = config.rollout.vllm.dtype
    return None if dtype == "auto" else getattr(torch, dtype)


def setup_vllm(config: Config, policy: Policy, tokenizer: Any, run_dir: Path) -> Sampler:
    """rollout.engine=vllm (in this process) or vllm_server (a `vllm serve` process: `setup_vllm_server`)."""
    require_vllm()
    if world_size() > 1:
        raise ConfigError(
            f"rollout.engine={config.rollout.engine} runs in one process: use rollout.engine=hf under torchrun"
        )
    settings = config.rollout.vllm
    if config.rollout.engine == "vllm":
        return VLLMSampler(
            policy.model,
            tokenizer,
            max_num_seqs=config.rollout.generation_batch_size,
            kv_cache_gib=settings.kv_cache_gib,
            seed=config.seed,
            dtype=vllm_dtype(config),
        )
    return setup_vllm_server(config, policy, tokenizer, run_dir)


def setup_vllm_server(config: Config, policy: Policy, tokenizer: Any, run_dir: Path) -> Sampler:
    """gspo's own `vllm serve` (RUN/vllm_server), or the user's at rollout.vllm.url, synced by files or NCCL
    (rollout.vllm.weight_sync), and given the policy's weights before the first rollout."""
    settings = config.rollout.vllm
    if settings.url is None:
        server = VLLMServer(
            policy.model,
            tokenizer,
            run_path(run_dir, "vllm_server"),
            kv_cache_gib=settings.kv_cache_gib,
            seed=config.seed,
            dtype=vllm_dtype(config),
            startup_timeout=settings.timeout,
        )
        return server_sampler(server, tokenizer, settings.timeout)
    # the user's server: gspo writes where it reads (or broadcasts to it), and never stops it
    device = next(policy.model.parameters()).device
    if settings.weight_sync == "nccl" and device.type != "cuda":
        raise ConfigError(
            f"rollout.vllm.weight_sync=nccl broadcasts from the trainer's GPU, and the policy is on {device}: "
            "train on a CUDA device (device=auto or cuda), or set rollout.vllm.weight_sync=files"
        )
    external = ExternalVLLMServer(
        settings.url,
        directory=None if settings.weights_dir is None else Path(settings.weights_dir),
        weights_path=settings.server_weights_dir,
        weight_sync=settings.weight_sync,
        timeout=settings.timeout,
    )
    if settings.weight_sync == "nccl":
        from gspo.rollout.vllm_nccl import NCCLBroadcast  # vLLM's NCCL engine: imported only when used

        sync: WeightSync = NCCLBroadcast(external, policy.model, settings.nccl_address)
    else:
        sync = FileReload(external)
    external.first_sync(sync, policy.model, tokenizer)
    return server_sampler(external, tokenizer, settings.timeout, sync)


SAMPLERS: dict[str, SamplerFactory] = {
    "hf": hf_sampler,
    "openai": openai_sampler,
    "llama_cpp": llama_cpp_sampler,
    "vllm": setup_vllm,
    "vllm_server": setup_vllm,
}
"""rollout.engine's built-in choices; a user's factory is named by its file or module instead."""


def setup_sampler(config: Config, policy: Policy, tokenizer: Any, run_dir: Path) -> Sampler:
    """The sampler rollout.engine names: a built-in's (`SAMPLERS`) or the user's own factory,
    "path/file.py:function" or "module:function", called with (config, policy, tokenizer, run_dir); its
    errors name the file, and its sampler's rollouts are checked (gspo.rollout.samplers.CheckedSampler)."""
    name = config.rollout.engine
    if name in SAMPLERS:
        return SAMPLERS[name](config, policy, tokenizer, run_dir)
    try:
        factory = load_function(name, "sampler")
    except (CodeFileError, FileNotFoundError) as error:
        raise CodeFileError(f"rollout.engine: {error}") from error
    except (ValueError, TypeError, ImportError) as error:  # no such function, not a callable, no module
        raise ConfigError(f"rollout.engine: {error}") from error
    except (Exception, SystemExit) as error:  # a module that fails when imported
        raise CodeFileError(f"rollout.engine: importing {name!r} {raised(error, 'sampler')}") from error
    try:
        sampler = factory(config, policy, tokenizer, run_dir)
    except (Exception, SystemExit) as error:
        where = raised_where(error, factory)
        raise CodeFileError(
            f"rollout.engine: the sampler factory {name!r} {raised(error, 'sampler')}{where}"
        ) from error
    missing = [name for name in ("generate", "sync_weights", "current") if not hasattr(sampler, name)]
    if missing:
        raise ConfigError(
            f"rollout.engine: {name!r} returned a {type(sampler).__name__} without {', '.join(missing)}: a "
            "sampler has generate(), sync_weights() and current (gspo.rollout.samplers.Sampler)"
        )
    return CheckedSampler(sampler, name, tokenizer)  # its rollouts checked as a server's are
