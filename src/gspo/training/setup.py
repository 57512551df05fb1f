"""Building a run's parts once, each from the config: examples, rewards, run folder, model, policy, sampler."""

from __future__ import annotations

import contextlib
import copy
import math
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from gspo.config import Config, ConfigError
from gspo.core.attention import supports_segments
from gspo.core.layout import layout_is_exact
from gspo.learning.policy import Policy, UpdateSpec, score
from gspo.models import add_lora, is_lora, load_model
from gspo.parallel.collectives import broadcast_object
from gspo.parallel.group import is_main
from gspo.parallel.wrap import compute_dtype, full_parameters, wrap_model
from gspo.rollout.data import TASKS, Example, arithmetic_task, load_examples, split_eval
from gspo.rollout.openai import OpenAIBackend
from gspo.rollout.rewards import RewardFunction, resolve_reward
from gspo.rollout.samplers import HFSampler, Sampler
from gspo.training.checkpoint import latest_checkpoint


def build_examples(config: Config) -> tuple[list[Example], list[Example]]:
    """The (train, eval) problems of the configured task; deterministic for `task.seed`."""
    task = config.task
    try:
        if task.name == "file":
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
        elif task.name in TASKS:
            examples = TASKS[task.name](task.num_train + task.num_eval, seed=task.seed)
        else:
            raise ConfigError(f"task.name={task.name!r} is not one of {sorted(TASKS)} or 'file'")
        return split_eval(examples, task.num_eval, seed=task.seed)
    except ValueError as error:  # too many problems asked for, eval split too large, ...
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(f"task: {error} (see task.num_train, task.num_eval)") from error


def resolve_rewards(
    config: Config, custom: Mapping[str, RewardFunction] | None
) -> list[tuple[str, RewardFunction, float]]:
    """(name, function, weight) for each configured reward; `custom` callables override or add names."""
    custom = dict(custom or {})
    weights = dict(config.rewards)
    for name in custom:
        weights.setdefault(name, 1.0)
    return [
        (name, custom[name] if name in custom else resolve_reward(name), w) for name, w in weights.items()
    ]


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


def setup_run_dir(config: Config, resume: str | Path | None) -> tuple[Path, Path | None]:
    """The run folder and, when resuming, its latest checkpoint; a new folder must hold no run yet."""
    if resume is not None:
        run_dir = Path(resume)
        checkpoint = latest_checkpoint(run_dir)
        if checkpoint is None:
            raise FileNotFoundError(
                f"no complete checkpoint in {run_dir}/checkpoints: start a new run instead"
            )
        return run_dir, checkpoint
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    # rank 0's name: the ranks' clocks may straddle a second
    run_dir = Path(broadcast_object(config.output_dir or f"runs/{config.train.objective}-{stamp}"))
    if latest_checkpoint(run_dir) is not None:
        raise FileExistsError(
            f"{run_dir} already holds a run: continue it with `gspo train --resume {run_dir}` or choose another output_dir"
        )
    if is_main():
        run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir, None


def setup_model(config: Config, checkpoint: Path | None) -> tuple[Any, Any]:
    """The policy model (on the CPU; a checkpoint's weights when resuming) and its tokenizer."""
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


def choose_layout(config: Config, model: torch.nn.Module, pad_id: int) -> str:
    """train.packing, with "auto" resolved: the first of shared_prefix, packed, padded that a probe shows
    exact for this model (its log-probs equal to the padded layout's), with a one-line notice on fallback."""
    mode = config.train.packing
    if mode != "auto":
        return mode
    vocab = model.get_input_embeddings().num_embeddings
    device = next(model.parameters()).device
    spec = UpdateSpec(temperature=config.rollout.temperature, chunk_size=config.train.logprob_chunk_size)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
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
            f"train.packing=auto: this model's attention {why}: training on {layout} rows, which compute "
            f"each prompt once per sample (set train.packing={layout} to skip this probe)",
            stacklevel=2,
        )
    return layout


def resolve_old_logprobs(config: Config, sampler: Sampler) -> str:
    """train.old_logprobs, with "auto" resolved: the sampler's log-probs when the sampler is the trainer's
    own model in its compute dtype (they are the old policy's, up to float rounding) and no mismatch correction
    needs both, else recompute."""
    mode = config.train.old_logprobs
    if mode != "auto":
        return mode
    return "sampler" if sampler.current and config.train.sampler_correction == "none" else "recompute"


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
    total_updates = config.train.steps * config.train.minibatches_per_rollout
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(config, total_updates))
    return Policy(model, optimizer, scheduler, scorer=scorer, reference=reference, compute_dtype=dtype)


def setup_sampler(config: Config, policy: Policy, tokenizer: Any) -> Sampler:
    """rollout.engine: the trainer's own model, or an OpenAI-compatible server."""
    if config.rollout.engine == "hf":
        return HFSampler(
            policy.model, tokenizer, config.rollout.generation_batch_size, lambda: generating(policy)
        )
    server = config.rollout.server
    warnings.warn(
        f"rollout.engine=openai: {server.url} samples from its own weights, which gspo train does not update; "
        "its rollouts drift off-policy as training goes on, and the old-policy log-probs are recomputed "
        "(pass Trainer(sampler=OpenAIBackend(..., weight_sync=...)) from Python to sync them)",
        stacklevel=2,
    )
    return OpenAIBackend(
        server.url,
        tokenizer,
        model=server.model,
        max_concurrency=server.concurrency,
        timeout=server.timeout,
        send_token_ids=server.token_ids,
        api_key=os.environ.get(server.api_key_env) or None,
    )


@contextlib.contextmanager
def generating(policy: Policy) -> Iterator[None]:
    """FSDP2's gathered parameters and the compute dtype, around in-process generation."""
    with full_parameters(policy.scorer), policy.autocast():
        yield
