"""Checkpoint state of the policy in one format whatever the wrapper or number of ranks.

torch.distributed.checkpoint's state_dict helpers gather FSDP2's shards into full tensors on rank 0 (and
shard a full state again on load), and key the optimizer state by parameter name, so a checkpoint written
by N ranks under FSDP2 resumes under DDP or in one process, and back.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from gspo.config import ConfigError
from gspo.parallel.collectives import all_gather_objects
from gspo.parallel.group import rank, world_size
from gspo.parallel.wrap import is_fsdp

_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)  # full tensors, on rank 0's CPU


class _FullStateModel:
    """Saves like the model (``save_pretrained``) but from a full state dict gathered on rank 0."""

    def __init__(self, model: Any, state_dict: dict[str, Tensor]) -> None:
        self.model, self.state_dict = model, state_dict

    def save_pretrained(self, directory: Any) -> None:
        self.model.save_pretrained(directory, state_dict=self.state_dict)


def savable_model(scorer: nn.Module, model: Any) -> Any:
    """What to ``save_pretrained``: the model itself, or under FSDP2 its full weights gathered on rank 0.

    Collective under FSDP2: every rank calls it.
    """
    return _FullStateModel(model, get_model_state_dict(model, options=_GATHER)) if is_fsdp(scorer) else model


def optimizer_state(model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's full state keyed by parameter name (under FSDP2 gathered; collective)."""
    if not optimizer.state:  # before the first update: nothing to save (and reading it would initialise it)
        return {"state": {}, "param_groups": []}
    return get_optimizer_state_dict(model, optimizer, options=_GATHER)


def load_optimizer_state(model: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> None:
    """Load a full optimizer state (every rank passes the same); under FSDP2 each rank keeps its shard."""
    if not state["state"]:  # saved before the first update: the fresh optimizer is that state
        return
    # strict=False: a parameter may have no state (no gradient yet), which DCP refuses by default
    set_optimizer_state_dict(
        model, optimizer, state, options=StateDictOptions(full_state_dict=True, strict=False)
    )
    # loading first gives every parameter a state (a zero-gradient step); one that had none when saved
    # (an expert no token was routed to) must have none now, or its next step's bias correction differs
    names = {param: name for name, param in model.named_parameters()}
    for param in [p for p in optimizer.state if names.get(p) not in state["state"]]:
        del optimizer.state[param]


RANK_KEYS = ("rng", "stream", "ahead")
"""What each rank keeps of its own in a checkpoint: its random streams, its data position, the rollout
batches it drew ahead (rollout.lag)."""


def rank_states(mine: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's `RANK_KEYS` state, in rank order (for the checkpoint)."""
    return all_gather_objects({key: mine[key] for key in RANK_KEYS if key in mine})


def resume_rank_state(state: dict[str, Any]) -> dict[str, Any]:
    """This rank's {"rng", "stream"} (a served run's: {"rng"}) from a checkpoint; the run must resume on as many ranks as it ran."""
    saved = state.get("ranks")
    size = world_size()
    saved_size = len(saved) if saved is not None else 1
    if saved_size != size:
        raise ConfigError(
            f"the checkpoint was written by {saved_size} process(es) and this run has {size}: resume with "
            f"--nproc_per_node {saved_size} (each rank's sampling RNG stream is restored, so the count "
            "must match for an exact continuation)"
        )
    if saved is None:  # one process; `gspo serve` keeps no data position
        return {key: state[key] for key in RANK_KEYS if key in state}
    return saved[rank()]
