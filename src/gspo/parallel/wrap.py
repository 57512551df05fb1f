"""The policy wrapped for data parallelism (DDP or FSDP2) around a module that computes log-probs.

The log-prob code calls the model's decoder and LM head weight directly, so DDP's reducer and FSDP2's
root hooks must wrap that whole computation, not ``model.forward``: :class:`LogprobScorer` is that module.
Generation, evaluation and saving use the unwrapped model; under FSDP2 inside :func:`full_parameters`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gspo.config import ConfigError, DistributedConfig
from gspo.core.layout import MicroBatch
from gspo.core.row_slices import lm_logprobs
from gspo.parallel.collectives import all_reduce_max
from gspo.parallel.group import world_size


class LogprobScorer(nn.Module):
    """``forward(input_ids, **kw) = lm_logprobs(model, input_ids, **kw)`` (causal_lm_logprobs, or a slice of
    it under sequence parallelism): the module that DDP or
    FSDP2 wraps, so that the whole log-prob computation (decoder and LM head) runs inside its hooks.

    ``autocast_dtype``: mixed precision for DDP or one process (FSDP2 casts parameters through its own
    policy instead).
    """

    def __init__(self, model: nn.Module, autocast_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.model = model
        self.autocast_dtype = autocast_dtype

    def forward(self, input_ids: Tensor, **kwargs: Any) -> Tensor:
        with torch.autocast(
            input_ids.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None
        ):
            # a fresh tensor, not a view: FSDP2 hooks its backward on the output (see its warning)
            return lm_logprobs(self.model, input_ids, **kwargs).clone()


def is_scorer(module: Any) -> bool:
    """A wrapped scorer (DDP or FSDP2 around a LogprobScorer) rather than a bare model."""
    return isinstance(module, (LogprobScorer, nn.parallel.DistributedDataParallel))


def _sum_gradients_hook(group, bucket):  # no annotations: DDP checks them, and ours are strings
    """DDP comm hook: all-reduce (sum) a bucket of gradients (dist.GradBucket) -> Future[Tensor]."""
    # DDP's default hook averages; our per-rank losses already carry the global normaliser, so the
    # one-process gradient is the plain sum of the ranks' gradients
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _fsdp_module_type() -> type:
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def _fsdp_modules(module: nn.Module) -> list[nn.Module]:
    fsdp = _fsdp_module_type()
    return [m for m in module.modules() if isinstance(m, fsdp)]


def compute_dtype(mixed_precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of ``train.mixed_precision`` on ``device``; None: no mixed precision."""
    if mixed_precision == "none" or (mixed_precision == "auto" and device.type != "cuda"):
        return None
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"train.mixed_precision={mixed_precision} needs bf16, which {torch.cuda.get_device_name(device)} "
            "lacks: set train.mixed_precision=none"
        )
    return torch.bfloat16


def wrap_model(
    model: nn.Module, config: DistributedConfig, device: torch.device, dtype: torch.dtype | None = None
) -> nn.Module:
    """The policy wrapped for data parallelism (``config.wrapper``); in one process the model itself
    (or, with mixed precision, a LogprobScorer that autocasts it).

    ddp: DDP(LogprobScorer(model)) with summed gradients; rank 0's weights are broadcast.
    fsdp2: fully_shard on each decoder layer (the model's ``_no_split_modules`` classes) and on the scorer
    (embeddings, final norm, LM head), summed gradients; every rank must hold the same initial weights
    (they do: same seed or the same checkpoint). ``dtype`` (see :func:`compute_dtype`): mixed precision,
    computing in that dtype with fp32 master weights and fp32 gradient reduction.
    """
    if world_size() == 1:
        return LogprobScorer(model, dtype) if dtype is not None else model
    if config.wrapper == "ddp":
        scorer = LogprobScorer(model, dtype)
        ddp = nn.parallel.DistributedDataParallel(
            scorer,
            device_ids=[device.index] if device.type == "cuda" else None,
            forward_sync_buffers=False,  # rotary tables etc. are constants: no collective in each forward
            find_unused_parameters=config.find_unused_parameters,
        )
        ddp.register_comm_hook(None, _sum_gradients_hook)
        return ddp
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(dtype, torch.float32) if dtype is not None else MixedPrecisionPolicy()
    layer_types = set(getattr(model, "_no_split_modules", None) or ())
    for module in list(model.modules()):
        if type(module).__name__ in layer_types:
            fully_shard(module, mp_policy=policy)
    scorer = LogprobScorer(model)
    # the root (embeddings, final norm, head) reshards after forward like the layers, so that no
    # no-grad forward leaves a gathered copy that a later optimizer step would make stale
    fully_shard(scorer, mp_policy=policy, reshard_after_forward=True)
    for module in _fsdp_modules(scorer):
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM; a plain sum is exact
        if config.find_unused_parameters:
            module.set_reduce_scatter_unused_params(True, recurse=False)
    # one forward initialises FSDP2's root state (generation later calls the inner modules directly);
    # resharding after it registers the sharded parameters again, the ones the optimizer must hold
    with torch.no_grad():
        scorer(torch.zeros((1, 2), dtype=torch.long, device=device))
    scorer.reshard()
    return scorer


def is_fsdp(scorer: nn.Module) -> bool:
    return isinstance(scorer, _fsdp_module_type())


@contextlib.contextmanager
def full_parameters(scorer: nn.Module) -> Iterator[None]:
    """Under FSDP2: all parameters gathered for the block (generation), resharded after; else nothing.

    Generation runs one forward per token and ranks stop at different lengths; with parameters gathered
    once up front, those forwards need no collective, so no rank waits on another.
    """
    if not is_fsdp(scorer):
        yield
        return
    modules = _fsdp_modules(scorer)
    for module in modules:  # the same order on every rank: these are the collectives
        module.unshard()
        module.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for module in modules:
            module.set_reshard_after_forward(True, recurse=False)
            module.reshard()


def set_gradient_sync(scorer: nn.Module, enabled: bool) -> None:
    """DDP: all-reduce gradients in the next backward or only accumulate them (its ``no_sync``, which
    must cover the forward too). FSDP2 reduce-scatters in every backward regardless, keeping only
    sharded gradients between micro-batches (memory is what FSDP2 is for)."""
    if isinstance(scorer, nn.parallel.DistributedDataParallel):
        scorer.require_backward_grad_sync = enabled


def idle_micro_batch(pad_id: int) -> MicroBatch:
    """A two-token micro-batch that scores nothing: its loss is exactly 0, its gradients exactly 0.

    Ranks with fewer micro-batches in a minibatch run these so every rank makes the same number of
    forward/backward passes (each one is a collective under FSDP2).
    """
    return MicroBatch(
        input_ids=torch.full((1, 2), pad_id, dtype=torch.long),
        position_ids=torch.arange(2).unsqueeze(0),
        attention_mask=None,
        logprob_mask=torch.zeros((1, 2), dtype=torch.bool),
        segment_ids=torch.full((2,), -1, dtype=torch.long),
        indices=[],
    )


def pad_micro_batches(minibatches: list[list[MicroBatch]], pad_id: int) -> list[list[MicroBatch]]:
    """Append idle micro-batches so each minibatch has as many micro-batches on every rank."""
    counts = all_reduce_max([len(m) for m in minibatches])
    return [
        m + [idle_micro_batch(pad_id) for _ in range(n - len(m))]
        for m, n in zip(minibatches, counts, strict=True)
    ]
