"""The policy of a run, built from its config: its objective registered, the model (a checkpoint's weights
when resuming), the training layout, and the optimizer and schedule around it (gspo.run.start calls these
for `gspo train` and `gspo serve` alike)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from gspo.config import Config, ConfigError, ModelConfig
from gspo.core.attention import supports_segments
from gspo.core.layout import layout_is_exact
from gspo.core.objectives import LossSpec
from gspo.core.row_slices import supports_split
from gspo.core.surrogates import register_objective
from gspo.learning.policy import Policy, UpdateSpec, entropy_control, score, update_choices
from gspo.models import add_lora, default_model_file, is_lora, load_model
from gspo.models.loading import align_parameters, quiet_peft
from gspo.parallel.wrap import compute_dtype, full_parameters, wrap_model
from gspo.rollout.user_code import CodeFileError, load_function
from gspo.run.checkpoint import verify_checkpoint


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
    fields = {f.name: getattr(config.train, f.name) for f in dataclasses.fields(LossSpec)}
    # "auto" as it resolves for stale samples, the one that constrains the objective (update_choices)
    fields["sampler_correction"] = update_choices(config, None, exact=False, stale=True)[1]
    try:
        LossSpec(**fields)
    except ValueError as error:  # a knob the objective does not have, a correction of the wrong level
        raise ConfigError(f"train: {error}") from error


def lr_schedule(config: Config, total_updates: int) -> Callable[[int], float]:
    """The learning-rate factor of each optimizer update: linear warm-up, then constant, cosine or linear
    (down to 0 at `total_updates`, as transformers' "linear" schedule, TRL's default)."""
    warmup, schedule = config.train.warmup_updates, config.train.schedule

    def factor(update: int) -> float:
        if update < warmup:
            return (update + 1) / warmup
        if schedule == "constant":
            return 1.0
        if schedule == "linear":  # written as transformers writes it, so the factors are the same floats
            return max(0.0, (total_updates - update) / max(1, total_updates - warmup))
        progress = min(1.0, (update - warmup) / max(1, total_updates - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

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

            with quiet_peft():
                model = peft.PeftModel.from_pretrained(model, checkpoint / "model", is_trainable=True)
            model.eval()
        else:
            model = add_lora(model, config.lora)
    return align_parameters(model), tokenizer  # the adapters too: a resumed run computes as the first


def load_checkpoint_policy(config: Config, checkpoint: Path) -> tuple[Any, Any]:
    """A saved policy as one plain model (LoRA adapters merged into the base weights) and its tokenizer;
    `config` is the run's own (its model and LoRA settings)."""
    model, tokenizer = setup_model(config, checkpoint)
    if is_lora(model):
        with quiet_peft():
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
    return Policy(
        model,
        optimizer,
        scheduler,
        scorer=scorer,
        reference=reference,
        compute_dtype=dtype,
        entropy=entropy_control(config),
    )


@contextlib.contextmanager
def generating(policy: Policy) -> Iterator[None]:
    """FSDP2's gathered parameters and the compute dtype, around in-process generation."""
    with full_parameters(policy.scorer), policy.autocast():
        yield
