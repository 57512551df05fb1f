"""Building a run's parts once, each from the config: examples, rewards, model, policy, sampler (the run
folder: gspo.training.run_folder)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import math
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from gspo.config import Config, ConfigError, ModelConfig
from gspo.core.attention import supports_segments
from gspo.core.layout import TokenSequence, layout_is_exact, make_micro_batches
from gspo.core.objectives import LossSpec
from gspo.core.sequence_parallel import supports_split
from gspo.core.surrogates import register_objective
from gspo.learning.learner import place
from gspo.learning.policy import Policy, UpdateSpec, score
from gspo.models import add_lora, default_model_file, is_lora, load_model
from gspo.parallel.group import world_size
from gspo.parallel.wrap import compute_dtype, full_parameters, wrap_model
from gspo.rollout.data import (
    TASKS,
    DataError,
    Example,
    arithmetic_task,
    format_prompt,
    load_examples,
    split_eval,
)
from gspo.rollout.llama_cpp import GGUFReload, LlamaCppServer, export_policy, require_llama_cpp
from gspo.rollout.openai import OpenAIBackend, WeightSync, api_key_problem
from gspo.rollout.reasoning_gym import reasoning_gym_task
from gspo.rollout.rewards import RewardFunction, resolve_reward, with_timeout
from gspo.rollout.samplers import HFSampler, Sampler, tokenize_prompts
from gspo.rollout.user_code import CodeFileError, load_function
from gspo.rollout.vllm_engine import VLLMSampler, require_vllm
from gspo.rollout.vllm_server import ExternalVLLMServer, FileReload, VLLMServer, server_sampler
from gspo.training.checkpoint import verify_checkpoint
from gspo.training.run_paths import run_path


def build_examples(config: Config) -> tuple[list[Example], list[Example]]:
    """The (train, eval) problems of the configured task; deterministic for `task.seed`."""
    task = config.task
    try:
        if task.name == "file":
            if task.data_path is not None and not Path(task.data_path).exists():
                raise FileNotFoundError(
                    f"task.data_path: data file not found: {task.data_path} (a path in a config file is read "
                    "relative to that file's folder, one on the command line relative to the working "
                    "directory)"
                )
            examples = load_examples(
                task.data_path, prompt_field=task.prompt_field, answer_fields=tuple(task.answer_fields)
            )
        elif task.name == "arithmetic":
            examples = arithmetic_task(
                task.num_train + task.num_eval,
                operand_min=task.operand_min,
                operand_max=task.operand_max,
                operations=task.operations,
                num_operands=task.num_operands,
                seed=task.seed,
            )
        elif task.name == "reasoning_gym":
            examples = reasoning_gym_task(
                task.num_train + task.num_eval,
                dataset=task.dataset,
                dataset_config=task.dataset_config,
                seed=task.seed,
            )
        elif task.name in TASKS:
            examples = TASKS[task.name](task.num_train + task.num_eval, seed=task.seed)
        else:
            raise ConfigError(
                f"task.name={task.name!r} is not one of {sorted(TASKS)}, 'reasoning_gym' or 'file'"
            )
        return split_eval(examples, task.num_eval, seed=task.seed)
    except ValueError as error:  # too many problems asked for, eval split too large, ...
        if isinstance(error, (ConfigError, DataError)):  # a data file's error names the file and the row
            raise
        raise ConfigError(f"task: {error} (see task.num_train, task.num_eval)") from error


def resolve_rewards(
    config: Config, custom: Mapping[str, RewardFunction] | None
) -> list[tuple[str, RewardFunction, float]]:
    """(name, function, weight) of the run's rewards, in order; the first is the eval accuracy.

    `custom` (Python callables by name) replaces config.rewards, as TRL's reward_funcs do: the run's
    rewards are exactly these, each weighing config.rewards[name] where the config names it, else 1.0.
    """
    custom = dict(custom or {})
    weights = {name: config.rewards.get(name, 1.0) for name in custom} if custom else dict(config.rewards)
    labels = {name: name for name in custom} if custom else reward_labels(list(weights))
    resolved = []
    for name, weight in weights.items():
        try:
            function = custom[name] if name in custom else resolve_reward(name)
        except (CodeFileError, FileNotFoundError) as error:  # the file: missing, or failing when run
            raise CodeFileError(f"rewards.{name}: {error}") from error
        except (ValueError, TypeError, ImportError) as error:  # unknown name, no such function, ...
            raise ConfigError(f"rewards.{name}: {error}") from error
        except (Exception, SystemExit) as error:  # a module (module:function) that fails when imported
            raise CodeFileError(
                f"rewards.{name}: importing it raised {type(error).__name__}: {error}"
            ) from error
        label = labels[name]
        resolved.append((label, with_timeout(function, config.reward_timeout, label), weight))
    return resolved


def setup_objective(config: Config) -> None:
    """Register train.objective when it is the user's own ("path/file.py:function" or "module:function", a
    terms function declared with @gspo.objective) and check the config's knobs against it; a built-in needs
    nothing. Errors name train.objective."""
    name = config.train.objective
    if ":" in name:
        try:
            register_objective(name, load_function(name, "objective"))
        except (CodeFileError, FileNotFoundError) as error:
            raise CodeFileError(f"train.objective: {error}") from error
        except (ValueError, TypeError, ImportError) as error:  # undeclared, no such function, ...
            raise ConfigError(f"train.objective: {error}") from error
        except (Exception, SystemExit) as error:  # a module that fails when imported
            raise CodeFileError(
                f"train.objective: importing {name!r} raised {type(error).__name__}: {error}"
            ) from error
    try:
        LossSpec(**{f.name: getattr(config.train, f.name) for f in dataclasses.fields(LossSpec)})
    except ValueError as error:  # a knob the objective does not have, a correction of the wrong level
        raise ConfigError(f"train: {error}") from error


def reward_labels(names: list[str]) -> dict[str, str]:
    """Each configured reward's name in metrics, reports and messages: its function's name, as TRL names
    them ("reward/exact_capital", not the file's absolute path), or the whole key where two share one.

    >>> reward_labels(["correct_number", "/tasks/capitals/rewards.py:exact_capital"])
    {'correct_number': 'correct_number', '/tasks/capitals/rewards.py:exact_capital': 'exact_capital'}
    """
    short = {name: name.rpartition(":")[2] for name in names}
    counts = {label: list(short.values()).count(label) for label in short.values()}
    return {name: label if counts[label] == 1 else name for name, label in short.items()}


def check_examples(rewards: list[tuple[str, RewardFunction, float]], examples: list[Example]) -> None:
    """Every example has the fields each reward function needs (its keyword-only parameters without a
    default) and passes the function's own `validate_example`, if any: found at start-up, not when the
    row is first drawn."""
    for name, function, _ in rewards:
        try:
            parameters = inspect.signature(function).parameters.values()
        except (TypeError, ValueError):  # some callables have no signature to read
            parameters = []
        needed = [p.name for p in parameters if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
        validate = getattr(function, "validate_example", None)
        for index, example in enumerate(examples):
            where = example.source or f"example {index} ({example.prompt[:60]!r})"
            missing = [field for field in needed if field not in example.fields]
            if missing:
                raise DataError(
                    f"{where}: reward {name!r} needs the field(s) {missing}, and the example has "
                    f"{sorted(example.fields)} (set task.answer_fields)"
                )
            if validate is not None:
                try:
                    validate(example.fields)
                except ValueError as error:
                    raise DataError(f"{where}: {error}, which reward {name!r} cannot use") from None


def check_prompt_lengths(
    config: Config, tokenizer: Any, model: torch.nn.Module, train: list[Example], held_out: list[Example]
) -> dict[str, int]:
    """Every prompt (with the chat template) plus the completion length fits the model's context; returns
    the longest sequence, prompt and completion, of the rollouts and of the evaluation."""
    context = getattr(model.config, "max_position_embeddings", None) or math.inf
    longest = {}
    for examples, budget, key in (
        (train, config.rollout.max_new_tokens, "rollout.max_new_tokens"),
        (held_out, config.eval.max_new_tokens, "eval.max_new_tokens"),
    ):
        prompts = [
            format_prompt(tokenizer, ex.prompt, system_prompt=config.task.system_prompt) for ex in examples
        ]
        lengths = [len(ids) for ids in tokenize_prompts(tokenizer, prompts)] if prompts else []
        longest[key] = max(lengths, default=0) + budget
        too_long = [i for i, n in enumerate(lengths) if n + budget > context]
        if too_long:
            i = too_long[0]
            where = examples[i].source or f"example {examples[i].prompt[:60]!r}"
            others = f" ({len(too_long) - 1} more prompts are too long)" if len(too_long) > 1 else ""
            raise DataError(
                f"{where}: the prompt is {lengths[i]} tokens with the chat template, + {key}={budget} = "
                f"{lengths[i] + budget} > the model's context of {context} tokens{others}: shorten or drop "
                f"it, or lower {key}"
            )
    return longest


def kv_cache_bytes(model: torch.nn.Module, sequences: int, tokens: int) -> int:
    """The key/value cache of `sequences` slots of `tokens` positions (gspo.rollout.kv_cache.SlotCache):
    2 (keys, values) x layers x sequences x kv_heads x tokens x head_dim x the weights' element size."""
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    element = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * sequences * kv_heads * tokens * head_dim * element


def available_memory(device: torch.device) -> int:
    """Bytes free for new tensors on `device`: the GPU's free memory, or the system's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with contextlib.suppress(OSError, ValueError, StopIteration), open("/proc/meminfo") as meminfo:
        line = next(line for line in meminfo if line.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def check_sizes(
    config: Config, tokenizer: Any, model: torch.nn.Module, train: list[Example], held_out: list[Example]
) -> None:
    """Before generating: every prompt fits the model's context with its completion, and the key/value
    cache of the rollout (rollout.engine=hf) and of the evaluation fits the memory free on the model's
    device; refused with the estimate."""
    longest = check_prompt_lengths(config, tokenizer, model, train, held_out)
    check_generation_memory(config, model, longest, len(held_out), next(model.parameters()).device)


def check_generation_memory(
    config: Config, model: torch.nn.Module, longest: dict[str, int], num_eval: int, device: torch.device
) -> None:
    """Refuse, before generating, sizes whose key/value cache cannot fit in the memory available on the
    device that generates (rollout.engine=hf, and every evaluation), with the estimate."""
    rollout = config.rollout
    needs = [
        (
            min(config.eval.batch_size, num_eval),
            longest.get("eval.max_new_tokens", 0),
            "eval.batch_size",
            "eval.max_new_tokens",
        )
    ]
    if rollout.engine == "hf":
        batch = rollout.prompts_per_step * rollout.group_size
        needs.append(
            (
                min(rollout.generation_batch_size, batch),
                longest.get("rollout.max_new_tokens", 0),
                "rollout.generation_batch_size",
                "rollout.max_new_tokens",
            )
        )
    free = available_memory(device)
    for sequences, tokens, slots_key, tokens_key in needs:
        need = kv_cache_bytes(model, sequences, tokens)
        if need > free:
            raise ConfigError(
                f"{sequences} sequences of up to {tokens:,} tokens ({slots_key}, the longest prompt + "
                f"{tokens_key}) need a key/value cache of about {_size(need)}, and {_size(free)} is free on "
                f"{device}: lower {slots_key} or {tokens_key}"
            )


def lr_schedule(config: Config, total_updates: int) -> Callable[[int], float]:
    """The learning-rate factor of each optimizer update: linear warm-up, then constant or cosine."""
    warmup, cosine = config.train.warmup_updates, config.train.schedule == "cosine"

    def factor(update: int) -> float:
        if update < warmup:
            return (update + 1) / warmup
        if not cosine:
            return 1.0
        progress = (update - warmup) / max(1, total_updates - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def setup_model(config: Config, checkpoint: Path | None) -> tuple[Any, Any]:
    """The policy model (on the CPU; a checkpoint's weights when resuming, checked against its manifest
    first) and its tokenizer."""
    if checkpoint is not None:
        verify_checkpoint(checkpoint)
    if checkpoint is not None and config.lora.rank == 0:
        saved = copy.copy(config.model)
        saved.path, saved.tiny = str(checkpoint / "model"), None
        return load_model(saved, seed=config.seed)
    model, tokenizer = load_model(config.model, seed=config.seed)
    if config.lora.rank > 0:
        if checkpoint is not None:
            import peft

            model = peft.PeftModel.from_pretrained(model, checkpoint / "model", is_trainable=True)
            model.eval()
        else:
            model = add_lora(model, config.lora)
    return model, tokenizer


def load_checkpoint_policy(config: Config, checkpoint: Path) -> tuple[Any, Any]:
    """A saved policy as one plain model (LoRA adapters merged into the base weights) and its tokenizer;
    `config` is the run's own (its model and LoRA settings)."""
    model, tokenizer = setup_model(config, checkpoint)
    if is_lora(model):
        model = model.merge_and_unload()
    model.eval()
    return model, tokenizer


def source_gguf(config: ModelConfig) -> Path | None:
    """The GGUF file a run's model was loaded from (model.path, or the embedded model), or None."""
    if config.tiny is not None:
        return None
    if config.path is None:
        return default_model_file()
    return Path(config.path) if Path(config.path).suffix == ".gguf" else None


def choose_layout(config: Config, model: torch.nn.Module, pad_id: int) -> str:
    """train.layout, with "auto" resolved: the first of shared_prefix, packed, padded that a probe shows
    exact for this model (its log-probs equal to the padded layout's), with a one-line notice on fallback;
    under distributed.sequence_parallel > 1, packed (a model whose attention cannot be split is an error)."""
    mode = config.train.layout
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if config.distributed.sequence_parallel > 1:  # packed rows, the one layout a split row supports
        if not supports_split(base.get_decoder()):
            raise ConfigError(
                f"distributed.sequence_parallel={config.distributed.sequence_parallel}: {type(base).__name__}'s "
                "attention cannot be split along the sequence (it needs sdpa or eager attention through "
                "transformers' AttentionInterface, without soft-capping or gradient checkpointing): set "
                "distributed.sequence_parallel=1"
            )
        return "packed"
    if mode != "auto":
        return mode
    vocab = model.get_input_embeddings().num_embeddings
    device = next(model.parameters()).device
    spec = UpdateSpec(
        temperature=config.rollout.temperature,
        logprob_chunk_size=config.train.logprob_chunk_size,
        logprob_kernel=config.train.logprob_kernel,
    )
    candidates = ["shared_prefix", "packed"] if supports_segments(base.get_decoder()) else ["packed"]
    for layout in candidates:
        with torch.no_grad():
            if layout_is_exact(lambda mb: score(model, mb.to(device), spec).cpu(), vocab, pad_id, layout):
                break
    else:
        layout = "padded"
    if layout != "shared_prefix":
        why = "cannot share a prompt among its samples" if layout == "packed" else "mixes packed sequences"
        warnings.warn(
            f"train.layout=auto: this model's attention {why}: training on {layout} rows, which compute "
            f"each prompt once per sample (set train.layout={layout} to skip this probe)",
            stacklevel=2,
        )
    return layout


VLLM_LOGPROB_TOLERANCE = 1e-4
"""The most a token's log-prob from vLLM may differ from the trainer's, on the start-up probe, for vLLM's
log-probs to serve as the old policy's under train.old_logprobs=auto: a third of GSPO's lower clip band
(3e-4), so that the mismatch alone moves no sequence ratio out of it. vLLM fp32 on a CPU: ~5e-7."""


def resolve_old_logprobs(config: Config, sampler: Sampler, policy: Policy, probe: list[Example]) -> str:
    """train.old_logprobs, with "auto" resolved: the sampler's log-probs when the trainer computes in fp32,
    no mismatch correction needs both, and the sampler is the trainer's own model (they are the old
    policy's up to fp32 rounding, ~1e-6) or vLLM within `VLLM_LOGPROB_TOLERANCE` of it on samples of the
    `probe` prompts; else recompute. In bf16 the cached token-by-token decoding and the trainer's
    whole-sequence forward round differently: on the default run every sequence's log-ratio left GSPO's
    3e-4 band (benchmarks/train_step.py train.mixed_precision=bf16 train.old_logprobs=sampler)."""
    mode = config.train.old_logprobs
    if mode != "auto":
        return mode
    if config.train.sampler_correction != "none" or policy.compute_dtype not in (None, torch.float32):
        return "recompute"
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
    return "sampler" if sampler.current else "recompute"


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


def setup_policy(config: Config, model: torch.nn.Module, device: torch.device, *, resumed: bool) -> Policy:
    """Reference model, data-parallel wrapper, fused AdamW and schedule around the model (on ``device``)."""
    reference = None
    if config.train.beta > 0 and not is_lora(model):  # with LoRA the base model is the reference
        if resumed:  # the policy has moved: rebuild the initial weights
            reference, _ = load_model(config.model, seed=config.seed)
        else:
            reference = copy.deepcopy(model)
        reference = reference.requires_grad_(False).to(device)
    dtype = compute_dtype(config.train.mixed_precision, device)
    scorer = wrap_model(model, config.distributed, device, dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params,
        lr=config.train.lr,
        betas=tuple(config.train.adam_betas),
        weight_decay=config.train.weight_decay,
        fused=True,  # one fused kernel per parameter: several times faster than the default loop on CPU
    )
    total_updates = config.train.steps * config.train.minibatches
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(config, total_updates))
    return Policy(model, optimizer, scheduler, scorer=scorer, reference=reference, compute_dtype=dtype)


def setup_sampler(config: Config, policy: Policy, tokenizer: Any, run_dir: Path) -> Sampler:
    """rollout.engine: the trainer's own model, an OpenAI-compatible server, a llama.cpp server of ours, or
    vLLM (`setup_vllm`)."""
    if config.rollout.engine == "hf":
        return HFSampler(
            policy.model, tokenizer, config.rollout.generation_batch_size, lambda: generating(policy)
        )
    if config.rollout.engine in ("vllm", "vllm_server"):
        return setup_vllm(config, policy, tokenizer, run_dir)
    if config.rollout.engine == "llama_cpp":
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
            run_dir / "vllm_server",
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


@contextlib.contextmanager
def generating(policy: Policy) -> Iterator[None]:
    """FSDP2's gathered parameters and the compute dtype, around in-process generation."""
    with full_parameters(policy.scorer), policy.autocast():
        yield
