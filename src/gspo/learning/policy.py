"""What the learner acts on (`Policy`) and how it updates it (`UpdateSpec`), as explicit inputs."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from gspo.config import Config
from gspo.core.layout import MicroBatch
from gspo.core.objectives import LossSpec
from gspo.core.registry import REGISTRY
from gspo.core.row_slices import lm_logprobs
from gspo.core.surrogates import LOSSES
from gspo.learning.embedding_rows import TiedRows
from gspo.learning.entropy import EntropyControl
from gspo.models.moe import is_moe
from gspo.parallel.group import world_size
from gspo.parallel.wrap import is_scorer


@dataclass(frozen=True)
class UpdateSpec:
    """How a batch becomes optimizer updates. Each field is the config key of the same name (``train.*``;
    max_new_tokens and temperature ``rollout.*``), `from_config` copies them; the loss's settings are
    ``loss``, a `LossSpec` (its knobs left None take the objective's paper defaults)."""

    loss: LossSpec = field(default_factory=LossSpec)
    max_new_tokens: int = 4
    """The constant of aggregation "seq-mean-token-sum-norm" (Dr. GRPO): the longest completion sampled."""
    advantage_scale: Literal["group", "batch", "none"] = "group"
    """gspo.core.advantages.group_advantages' scale of the centred rewards."""
    filter_zero_std_groups: bool = False
    """Drop the groups whose returns are all equal from the batch (make_batch)."""
    mask_truncated: bool = False
    """Truncated samples get no gradient (make_batch)."""
    skip_zero_advantage: bool = False
    """Leave the samples that move nothing out of the passes (train.skip_zero_advantage resolved)."""
    minibatches: int = 4
    minibatch_split: Literal["group", "sample"] = "sample"
    """"sample": each minibatch holds a random share of all samples; "group": whole groups (their prompt
    computed once)."""
    layout: Literal["shared_prefix", "packed", "padded"] = "shared_prefix"
    """gspo.core.layout: "shared_prefix", "packed" or "padded" (train.layout with "auto" resolved)."""
    pack_length: int = 1024
    micro_batch_tokens: int = 4096
    pad_id: int = 0
    temperature: float = 1.0
    logprob_chunk_size: int = 1024
    logprob_kernel: Literal["auto", "torch", "triton"] = "auto"
    """gspo.core.logprobs.KERNELS: "auto" (Triton on CUDA when installed), "torch" or "triton"."""
    max_grad_norm: float = 1.0
    old_logprobs: Literal["recompute", "sampler"] = "recompute"
    """"recompute" (a forward pass before the updates) or "sampler" (the sampler's own log-probs)."""
    routing_replay: bool = False
    sequence_parallel: int = 1
    """distributed.sequence_parallel: ranks that share each row, one slice of it each."""

    @classmethod
    def from_config(
        cls, config: Config, *, layout: str, pad_id: int, old_logprobs: str | None = None
    ) -> UpdateSpec:
        """The spec of a run: the same-named fields of ``config.rollout`` and ``config.train``, with train.layout
        and train.old_logprobs as resolved at start-up ("auto" is neither) and the tokenizer's pad_id."""
        fields = _same_named(cls, config.rollout) | _same_named(cls, config.train)
        loss = _same_named(LossSpec, config.train)
        if loss["sampler_correction"] == "auto":  # resolved per step (with_correction): none until then
            loss |= {
                "sampler_correction": "none",
                "sampler_correction_min": None,
                "sampler_correction_max": None,
            }
        fields["sequence_parallel"] = config.distributed.sequence_parallel
        fields |= {
            "layout": layout,
            "pad_id": pad_id,
            "old_logprobs": old_logprobs or config.train.old_logprobs,
            "skip_zero_advantage": skips_zero_advantage(config),
        }
        return cls(loss=LossSpec(**loss), **fields)


def update_choices(
    config: Config, compute_dtype: torch.dtype | None, *, exact: bool | Callable[[], bool], stale: bool
) -> tuple[str, str]:
    """(train.old_logprobs, train.sampler_correction) with "auto" resolved: the one rule of `gspo train` and
    `gspo serve` (docs/async.md).

    ``stale``: some samples were drawn by an older version of the weights (rollout.lag > 0, a served run's
    older records). The correction "auto" is then the decoupled objective's truncated behaviour weight,
    pi_prox / pi_behav with pi_prox recomputed at the current weights: sequence_truncate for the sequence
    objectives and gspo_token, token_truncate for the token ones; else (or with old_logprobs=sampler) none.
    A whole loss (``@gspo.objective(whole=True)``) applies its own: "auto" is none there, and the loss is
    given the sampler's log-probs (LossInputs.sampler_logp) to weigh stale samples with.
    ``exact``: the samples were drawn whole by the current weights (the trainer's own model, vLLM within
    tolerance of it, a server's records of the current version at the training temperature; a callable is
    asked only when needed). The sampler's log-probs then serve as the old policy's when the trainer
    computes in fp32 and no correction needs both; else they are recomputed. In bf16 the cached
    token-by-token decoding and the trainer's whole-sequence forward round differently: on the default run
    every sequence's log-ratio left GSPO's 3e-4 band."""
    correction, mode = config.train.sampler_correction, config.train.old_logprobs
    if correction == "auto" and config.train.objective in LOSSES:
        correction = "none"
    elif correction == "auto":
        sequence = (
            REGISTRY[config.train.objective].level == "sequence" or config.train.objective == "gspo_token"
        )
        truncate = "sequence_truncate" if sequence else "token_truncate"
        correction = truncate if stale and mode != "sampler" else "none"
    if mode == "auto":
        fp32 = compute_dtype in (None, torch.float32)
        current = correction == "none" and fp32 and not stale and (exact() if callable(exact) else exact)
        mode = "sampler" if current else "recompute"
    return mode, correction


def with_correction(config: Config, spec: UpdateSpec, mode: str, correction: str) -> UpdateSpec:
    """``spec`` with train.old_logprobs and train.sampler_correction as update_choices resolved them: the
    correction's bounds are train.sampler_correction_min / _max where one applies; "auto" resolved to none
    drops them (they bound the correction "auto" chooses for stale samples)."""
    bounds = (config.train.sampler_correction_min, config.train.sampler_correction_max)
    if correction == "none":
        bounds = (None, None)
    loss = dataclasses.replace(
        spec.loss,
        sampler_correction=correction,
        sampler_correction_min=bounds[0],
        sampler_correction_max=bounds[1],
    )
    return dataclasses.replace(spec, old_logprobs=mode, loss=loss)


def skips_zero_advantage(config: Config) -> bool:
    """train.skip_zero_advantage with "auto" resolved: on where skipping is exact, with neither a KL term
    (beta = 0) nor an entropy bonus, the terms of the loss a zero-advantage sample contributes to."""
    mode = config.train.skip_zero_advantage
    if mode == "auto":
        return config.train.beta == 0 and not entropy_bonus(config)
    return bool(mode)


def entropy_bonus(config: Config) -> bool:
    """Whether the updates carry an entropy bonus (a coefficient, or a target it adapts toward)."""
    return config.train.entropy_coef != 0 or config.train.entropy_target is not None


def entropy_control(config: Config) -> EntropyControl:
    """The entropy bonus's coefficient of a run, as train.entropy_* set it, before any update."""
    train = config.train
    return EntropyControl(
        train.entropy_coef, train.entropy_target, train.entropy_coef_delta, train.entropy_coef_max
    )


def _same_named(cls: type, section: object) -> dict[str, Any]:
    """The values of ``section``'s attributes named as fields of the dataclass ``cls``."""
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(cls) if hasattr(section, f.name)}


@dataclass
class Policy:
    """The model being trained and what updates it.

    model: the causal LM (peft-wrapped with LoRA): generation, saving, routing hooks; scorer: what computes
    log-probs with gradients, the model itself or its DDP/FSDP2/autocast wrapper (gspo.parallel.wrap);
    reference: the frozen initial policy of the KL term (None: with LoRA the adapters are switched off
    instead, or no KL term); compute_dtype: mixed precision (None: the parameters' dtype); entropy: the
    entropy bonus's coefficient, fixed or adapted (gspo.learning.entropy), learner state like the optimizer's.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scorer: nn.Module | None = None
    reference: nn.Module | None = None
    compute_dtype: torch.dtype | None = None
    entropy: EntropyControl = field(default_factory=EntropyControl)
    moe: bool = field(init=False)
    tied_rows: TiedRows = field(init=False)
    """A tied input embedding's gradient by rows (gspo.learning.embedding_rows), in the updates."""

    def __post_init__(self) -> None:
        self.scorer = self.model if self.scorer is None else self.scorer
        self.moe = is_moe(self.model)  # routing volatility is logged, Routing Replay possible
        self.tied_rows = TiedRows(self.model, one_process=world_size() == 1)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def autocast(self) -> torch.autocast:
        """The compute dtype, for passes that do not go through the scorer (generation, reference, MoE
        expert choices), so every pass computes like the policy's log-probs."""
        dtype = self.compute_dtype
        return torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None)

    def reference_logprobs(self, mb: MicroBatch, spec: UpdateSpec) -> torch.Tensor:
        """log pi_ref of a micro-batch's tokens (the KL anchor), computed like the policy's."""
        with self.autocast():
            if self.reference is not None:
                return score(self.reference, mb, spec)
            with self.model.disable_adapter():  # LoRA: the base model is the reference
                return score(self.model, mb, spec)


def score(model: nn.Module, mb: MicroBatch, spec: UpdateSpec) -> torch.Tensor:
    """log pi(token) of every completion token of a micro-batch, flattened to (R*L,); 0 elsewhere.

    `model`: a causal LM, or the data-parallel scorer wrapping it (gspo.parallel.wrap.wrap_model).
    """
    return _scored(model, mb, spec).reshape(-1)


def score_with_entropy(
    model: nn.Module, mb: MicroBatch, spec: UpdateSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """`score`, and the entropy of the distribution each completion token was drawn from (R*L,), with its
    gradient (the entropy bonus; whole rows only, not sequence-parallel slices)."""
    logp, entropy = _scored(model, mb, spec, entropy=True)
    return logp.reshape(-1), entropy.reshape(-1)


def _scored(model: nn.Module, mb: MicroBatch, spec: UpdateSpec, **entropy: bool) -> Any:
    scorer = model if is_scorer(model) else functools.partial(lm_logprobs, model)
    split = {"split": mb.split} if mb.split is not None else {}  # this rank's slice of the rows
    return scorer(
        mb.input_ids,
        attention_mask=mb.attention_mask,
        position_ids=mb.position_ids,
        logprob_mask=mb.logprob_mask,
        temperature=spec.temperature,
        chunk_size=spec.logprob_chunk_size,
        kernel=spec.logprob_kernel,
        prefix_tree=mb.prefix_tree,
        **split,
        **entropy,
    )
