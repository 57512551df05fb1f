"""The built-in samplers' factories, which gspo.config.engines names, and `build_sampler`: the sampler
rollout.engine names, a built-in's or the user's own factory ("path/file.py:function", "module:function",
under the trust rules of reward code: gspo.run.trust), whose rollouts are then checked as a server's are.
`sampler_is_current` measures whether a sampler's log-probs are the trainer's own (vLLM's, on a probe)."""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gspo.config import Config, ConfigError
from gspo.config.engines import engine_of
from gspo.core.layout import TokenSequence, make_micro_batches
from gspo.files import run_path
from gspo.learning.learner import place
from gspo.learning.policy import Policy, UpdateSpec, score
from gspo.parallel.group import world_size
from gspo.rollout.data import Example, format_prompt
from gspo.rollout.llama_cpp import GGUFReload, LlamaCppServer, export_policy, require_llama_cpp
from gspo.rollout.openai import OpenAIBackend, WeightSync, api_key_problem
from gspo.rollout.samplers import CheckedSampler, HFSampler, Sampler
from gspo.rollout.user_code import CodeFileError, load_function, raised, raised_where
from gspo.rollout.vllm_engine import VLLMSampler, require_vllm
from gspo.rollout.vllm_server import ExternalVLLMServer, FileReload, VLLMServer, server_sampler
from gspo.run.build import generating, source_gguf

SamplerFactory = Callable[[Config, Policy, Any, Path], Sampler]
"""A sampler's factory: (config, policy, tokenizer, run folder) -> `gspo.rollout.samplers.Sampler`."""


def hf_sampler(config: Config, policy: Policy, tokenizer: Any, run_dir: Path) -> Sampler:
    """rollout.engine=hf: the trainer's own model, in this process (gspo.rollout.hf_engine)."""
    return HFSampler(
        policy.model, tokenizer, config.rollout.generation_batch_size, lambda: generating(policy)
    )


def llama_cpp_sampler(config: Config, policy: Policy, tokenizer: Any, run_dir: Path) -> Sampler:
    """rollout.engine=llama_cpp: a llama.cpp server of ours, given the policy as GGUF files."""
    require_llama_cpp()  # before the export: its absence is known at once
    server = config.rollout.llama_cpp
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


def vllm_sampler(config: Config, policy: Policy, tokenizer: Any, run_dir: Path) -> Sampler:
    """rollout.engine=vllm: a vLLM engine in this process, given the policy's weights at every sync."""
    require_vllm()
    return VLLMSampler(
        policy.model,
        tokenizer,
        max_num_seqs=config.rollout.generation_batch_size,
        kv_cache_gib=config.rollout.vllm.kv_cache_gib,
        seed=config.seed,
        dtype=vllm_dtype(config),
    )


def vllm_server_sampler(config: Config, policy: Policy, tokenizer: Any, run_dir: Path) -> Sampler:
    """rollout.engine=vllm_server: gspo's own `vllm serve` (RUN/vllm_server), or the user's at
    rollout.vllm.url, synced by files or NCCL (rollout.vllm.weight_sync), and given the policy's weights
    before the first rollout."""
    require_vllm()
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


def build_sampler(config: Config, policy: Policy, tokenizer: Any, run_dir: Path) -> Sampler:
    """The sampler rollout.engine names: a built-in's (gspo.config.engines.ENGINES) or the user's own
    factory, "path/file.py:function" or "module:function", called with (config, policy, tokenizer, run_dir);
    its errors name the file, and its sampler's rollouts are checked (gspo.rollout.samplers.CheckedSampler)."""
    name, engine = config.rollout.engine, engine_of(config)
    if engine is not None and engine.one_process and world_size() > 1:
        raise ConfigError(f"rollout.engine={name} runs in one process: use rollout.engine=hf under torchrun")
    if engine is not None:
        module, _, function = engine.factory.partition(":")
        return getattr(importlib.import_module(module), function)(config, policy, tokenizer, run_dir)
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


VLLM_LOGPROB_TOLERANCE = 1e-4
"""The most a token's log-prob from vLLM may differ from the trainer's, on the start-up probe, for vLLM's
log-probs to serve as the old policy's under train.old_logprobs=auto: a third of GSPO's lower clip band
(3e-4), so that the mismatch alone moves no sequence ratio out of it. vLLM fp32 on a CPU: ~5e-7."""


def sampler_is_current(config: Config, sampler: Sampler, policy: Policy, probe: list[Example]) -> bool:
    """Whether ``sampler``'s log-probs are the current weights' own (the `exact` of
    gspo.learning.policy.update_choices): the trainer's own model is; vLLM is when it is within
    `VLLM_LOGPROB_TOLERANCE` of the trainer on samples of the `probe` prompts; a server is not."""
    if isinstance(sampler, VLLMSampler):
        sampler.logprob_gap = vllm_logprob_gap(config, policy, sampler, probe)
        sampler.current = sampler.logprob_gap <= VLLM_LOGPROB_TOLERANCE
        if not sampler.current:
            warnings.warn(
                f"train.old_logprobs=auto: vLLM's log-probs differ from the trainer's by up to "
                f"{sampler.logprob_gap:.1e} on a start-up probe (tolerance {VLLM_LOGPROB_TOLERANCE:.0e}): the "
                "old policy's are recomputed",
                stacklevel=2,
            )
    return sampler.current


def vllm_logprob_gap(config: Config, policy: Policy, sampler: VLLMSampler, probe: list[Example]) -> float:
    """The largest |log pi_vLLM - log pi_trainer| of a completion token over G=2 samples of each `probe`
    prompt, drawn as the rollouts are (temperature, length) with a fixed seed (the run's random streams
    stay untouched), and scored by the trainer's forward."""
    prompts = [
        format_prompt(sampler.tokenizer, ex.prompt, system_prompt=config.task.system_prompt) for ex in probe
    ]
    rollouts = sampler.generate(
        prompts,
        group_size=2,
        max_new_tokens=config.rollout.max_new_tokens,
        temperature=config.rollout.temperature,
        seed=config.seed,
    )
    sequences = [
        TokenSequence(p, c, [True] * len(c))
        for p, c in zip(rollouts.prompt_ids, rollouts.completion_ids, strict=True)
    ]
    spec = UpdateSpec(temperature=config.rollout.temperature, logprob_kernel=config.train.logprob_kernel)
    device = next(policy.model.parameters()).device
    gap = 0.0
    for mb in make_micro_batches(
        sequences,
        layout="padded",
        pack_length=config.train.pack_length,
        micro_batch_tokens=config.train.micro_batch_tokens,
        pad_id=0,
    ):
        mb = mb.to(device)
        with torch.no_grad(), policy.autocast():
            trainer = score(policy.scorer, mb, spec)
        mask = mb.logprob_mask.reshape(-1)
        engine = place(rollouts.sampler_logprobs, mb)
        gap = max(gap, (trainer[mask] - engine[mask]).abs().max().item())
    return gap
