"""Data-parallel training on torch.distributed (torchrun), exact across ranks: N ranks, one process's update.

Launch with ``torchrun --nproc_per_node N -m gspo train CONFIG``: every rank joins the process group that
torchrun describes in its environment (gloo on CPU, NCCL on CUDA), takes its slice of the global prompt
batch (whole groups), generates and scores it, and sees every rank's rewards, so advantages and reward
metrics are those of one process. The updates stay exact:

- minibatches are drawn from the global batch with one seeded permutation, each rank holding its own
  sequences of each minibatch, and the loss normaliser is the global count (``all_reduce_sum``), so every
  rank's loss is its share of the one-process loss and the ranks' gradients sum to its gradient;
- gradients are summed across ranks, not averaged (DDP: a sum comm hook; FSDP2: divide factor 1 with
  sum-only collectives), so nothing rescales the loss and no 1/N rounding enters;
- every rank runs the same number of forward and backward passes (``pad_micro_batches`` adds no-op
  micro-batches to the ranks with fewer), which FSDP2's per-layer collectives need.

The model is wrapped in a :class:`LogprobScorer`, a module whose forward is ``causal_lm_logprobs``: the
log-prob code calls the model's decoder and its LM head weight directly, so DDP's reducer and FSDP2's root
hooks must wrap that whole computation, not ``model.forward``. Generation, evaluation and saving use the
unwrapped model; under FSDP2 they run inside :func:`full_parameters` (all parameters gathered once, no
collective per decoding step, so ranks may stop generating at different times).

Sequence data parallelism (one completion's tokens split across ranks) is in gspo.sequence_parallel.

Every helper is the identity in a single process (no process group), so the trainer calls them always.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gspo.batching import MicroBatch
from gspo.config import ConfigError, DistributedConfig
from gspo.logprobs import causal_lm_logprobs

_created_group = False  # whether init_from_env made the process group (then shutdown destroys it)


# ---- process group ----------------------------------------------------------------------------------
def launched_world_size() -> int:
    """WORLD_SIZE from torchrun's environment; 1 when not launched by torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_backend(requested: str, device_type: str) -> str:
    """The backend to use; "auto" is NCCL for CUDA tensors, gloo for CPU ones."""
    if requested != "auto":
        return requested
    return "nccl" if device_type == "cuda" else "gloo"


def resolve_device(requested: str) -> torch.device:
    """The device of ``Config.device``: "auto" is a CUDA GPU when torch sees one, else the CPU; "cuda"
    (or "auto" on a GPU machine) is GPU LOCAL_RANK, so each torchrun rank on a node takes its own GPU."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            f"device={requested} but torch sees no CUDA GPU (torch {torch.__version__}, CUDA build: "
            f"{torch.version.cuda}): set device=cpu (or auto), or install a CUDA build of torch"
        )
    device = torch.device(requested)
    if device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    elif launched_world_size() > 1:
        raise ConfigError(
            f"device={requested} puts every torchrun rank on the same GPU: set device=cuda (or auto), "
            "which gives each rank GPU LOCAL_RANK"
        )
    if device.index >= torch.cuda.device_count():
        raise ConfigError(
            f"device={requested} resolves to {device}, but this machine has {torch.cuda.device_count()} "
            "GPU(s): pick an index below that, or launch at most that many ranks per node"
        )
    return device


def init_from_env(config: DistributedConfig, device: torch.device | None = None) -> bool:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

    A no-op in a single process or when a group already exists (tests, notebooks); returns whether it
    created the group. On a GPU, each rank first selects its ``device`` (NCCL needs it current).
    """
    global _created_group
    device = device or torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized() or launched_world_size() <= 1:
        return False
    backend = resolve_backend(config.backend, device.type)
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("distributed.backend=nccl needs CUDA tensors: set device=cuda (or auto on GPUs)")
    dist.init_process_group(backend, timeout=timedelta(minutes=config.timeout_minutes))
    _created_group = True
    return True


def shutdown() -> None:
    """Destroy the process group if :func:`init_from_env` created it."""
    global _created_group
    if _created_group and dist.is_initialized():
        dist.destroy_process_group()
    _created_group = False


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_main() -> bool:
    """Rank 0 (or a single process): the one that logs, plots and writes files."""
    return rank() == 0


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def rank_slice(items: list[Any]) -> list[Any]:
    """This rank's contiguous share of a list every rank holds in full (rank r gets the r-th block)."""
    n, size = len(items), world_size()
    if n % size:
        raise ValueError(f"{n} items do not split evenly across {size} ranks")
    share = n // size
    return items[rank() * share : (rank() + 1) * share]


# ---- collectives on values (identity in a single process) -------------------------------------------
def _device() -> torch.device:
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def all_reduce_sum(value: float) -> float:
    """Sum of a number over the ranks (float64, so counts stay exact)."""
    if world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=_device())
    dist.all_reduce(t)
    return float(t.item())


def all_reduce_max(values: list[int]) -> list[int]:
    """Element-wise maximum of an integer list over the ranks."""
    if world_size() == 1 or not values:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def all_gather_cat(t: Tensor) -> Tensor:
    """Concatenate a tensor of the same shape on every rank along dim 0, in rank order."""
    if world_size() == 1:
        return t
    parts = [torch.empty_like(t, device=_device()) for _ in range(world_size())]
    dist.all_gather(parts, t.to(_device()).contiguous())
    return torch.cat(parts).to(t.device)


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's picklable object, in rank order."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def all_gather_list(items: list[Any]) -> list[Any]:
    """Concatenation of every rank's list, in rank order."""
    return [x for part in all_gather_objects(list(items)) for x in part]


def all_gather_varlen(t: Tensor) -> Tensor:
    """Concatenate 1-D tensors of any lengths from every rank, in rank order."""
    if world_size() == 1:
        return t
    return torch.cat([part.to(t.device) for part in all_gather_objects(t.detach().cpu())])


def all_gather_metrics(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's list of metric dicts (values made floats), concatenated in rank order."""
    if world_size() == 1:
        return items
    return all_gather_list([{k: float(v) for k, v in m.items()} for m in items])


def broadcast_object(obj: Any) -> Any:
    """Rank 0's object on every rank."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def raise_together(error: Exception | None) -> None:
    """Raise on every rank when any rank failed: the failing rank its own error, the others one of the
    same type naming that rank.

    Without this a failing rank leaves the others blocked in their next collective; with it every rank
    reaches the failure handler together (which may itself use collectives, e.g. to checkpoint).
    """
    failures = all_gather_objects(None if error is None else (type(error), str(error)))
    if error is not None:
        raise error
    for source, failure in enumerate(failures):
        if failure is not None:
            kind, message = failure
            try:
                other = kind(f"on rank {source}: {message}")
            except Exception:  # an exception type with a different constructor
                other = RuntimeError(f"{kind.__name__} on rank {source}: {message}")
            raise other


class SilentLogger:
    """The metrics logger of ranks other than 0: every rank computes the (reduced) metrics, one writes."""

    def log(self, step: int, metrics: Any, kind: str = "train") -> None:
        pass

    def close(self) -> None:
        pass


# ---- the wrapped model ------------------------------------------------------------------------------
class LogprobScorer(nn.Module):
    """``forward(input_ids, **kw) = causal_lm_logprobs(model, input_ids, **kw)``: the module that DDP or
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
            return causal_lm_logprobs(self.model, input_ids, **kwargs).clone()


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


def clip_grad_norm(
    parameters: list[nn.Parameter], max_norm: float, optimizer: torch.optim.Optimizer | None = None
) -> Tensor:
    """Clip to a total gradient norm, the norm taken over all ranks' shards (DTensor) when sharded.

    With a fused ``optimizer`` (torch's fused AdamW) and plain tensors, the gradients are not rescaled
    here: the factor goes to the optimizer's next step as its ``grad_scale`` (the attribute GradScaler
    sets), which the fused kernel divides each gradient by as it reads it. The update is
    ``clip_grad_norm_``'s, without its read-and-write pass over every gradient.
    """
    if not parameters or not hasattr(parameters[0], "device_mesh"):  # plain tensors
        if optimizer is None or not optimizer.defaults.get("fused"):
            return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        grads = [p.grad for p in parameters if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        # clip_grad_norm_ multiplies by min(1, max_norm / (total + 1e-6)): divide by its inverse
        # (float32 whatever the gradients' dtype: the fused kernel reads it as such); the caller
        # removes it after the step (``release_grad_scale``), as GradScaler does
        optimizer.grad_scale = ((total.float() + 1e-6) / max_norm).clamp(min=1.0)
        return total
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total = torch.nn.utils.get_total_norm(grads)
    if hasattr(total, "full_tensor"):  # FSDP2: a partial norm per shard, reduced here
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total


def release_grad_scale(optimizer: torch.optim.Optimizer) -> None:
    """Forget a clipping factor :func:`clip_grad_norm` handed to ``optimizer`` once its step used it."""
    if hasattr(optimizer, "grad_scale"):
        del optimizer.grad_scale


# ---- checkpoints ------------------------------------------------------------------------------------
def _full(t: Any) -> Any:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class _FullStateModel:
    """Saves like the model (``save_pretrained``) but from a full state dict gathered on rank 0."""

    def __init__(self, model: Any, state_dict: dict[str, Tensor]) -> None:
        self.model, self.state_dict = model, state_dict

    def save_pretrained(self, directory: Any) -> None:
        self.model.save_pretrained(directory, state_dict=self.state_dict)


def savable_model(scorer: nn.Module, model: Any) -> Any:
    """What ``save_checkpoint`` should save: the model itself, or under FSDP2 a full copy on rank 0.

    Collective under FSDP2 (every rank gathers each shard in turn); only rank 0 keeps the full tensors.
    """
    if not is_fsdp(scorer):
        return model
    full: dict[str, Tensor] = {}
    for key, value in model.state_dict().items():
        gathered = _full(value)  # a collective: every rank, in the same order
        if is_main():
            full[key] = gathered.detach().cpu()
    return _FullStateModel(model, full)


def optimizer_state(scorer: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state_dict in the one-process format; under FSDP2 gathered from the shards.

    So a checkpoint resumes under any wrapper or number of ranks' optimizer layout. Collective under FSDP2.
    """
    state = optimizer.state_dict()
    if not is_fsdp(scorer):
        return state
    gathered = {}
    for index, values in state["state"].items():
        full = {k: _full(v) for k, v in values.items()}
        gathered[index] = {k: v.detach().cpu() for k, v in full.items()} if is_main() else {}
    return {"state": gathered, "param_groups": state["param_groups"]}


def load_optimizer_state(scorer: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a one-process-format optimizer state; under FSDP2 each rank keeps its shard of it."""
    if is_fsdp(scorer):
        from torch.distributed.tensor import distribute_tensor

        params = [p for group in optimizer.param_groups for p in group["params"]]
        sharded = {}
        for index, values in state["state"].items():
            param = params[int(index)]
            sharded[index] = {
                k: distribute_tensor(v, param.device_mesh, param.placements, src_data_rank=None)
                if v.dim() > 0 else v
                for k, v in values.items()
            }  # fmt: skip
        state = {"state": sharded, "param_groups": state["param_groups"]}
    optimizer.load_state_dict(state)


def rank_states(rng: dict[str, Any], stream: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's RNG state and data position, in rank order (for the checkpoint)."""
    return all_gather_objects({"rng": rng, "stream": stream})


def resume_rank_state(state: dict[str, Any]) -> dict[str, Any]:
    """This rank's {"rng", "stream"} from a checkpoint; the run must resume on as many ranks as it ran."""
    saved = state.get("ranks")
    size = world_size()
    saved_size = len(saved) if saved is not None else 1
    if saved_size != size:
        raise ConfigError(
            f"the checkpoint was written by {saved_size} process(es) and this run has {size}: resume with "
            f"--nproc_per_node {saved_size} (each rank's sampling RNG stream is restored, so the count "
            "must match for an exact continuation)"
        )
    if saved is None:
        return {"rng": state["rng"], "stream": state["stream"]}
    return saved[rank()]


def seed_rank(seed: int) -> None:
    """Give each rank its own sampling RNG streams (rank r: seed + r * 1_000_003)."""
    import random

    import numpy as np

    offset = seed + rank() * 1_000_003
    torch.manual_seed(offset)
    random.seed(offset)
    np.random.seed(offset % 2**32)
