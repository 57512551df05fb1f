"""The process group torchrun describes: joining it, this process's rank and device, per-rank seeds.

Every helper in gspo.parallel is the identity in a single process (no process group), so callers use them
always. docs/distributed.md explains how N ranks make exactly the one-process update.
"""

from __future__ import annotations

import os
import random
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gspo.config import ConfigError, DistributedConfig
from gspo.core.seeds import rank_seed

_created_group = False  # whether init_from_env made the process group (then shutdown destroys it)


def launched_world_size() -> int:
    """WORLD_SIZE from torchrun's environment; 1 when not launched by torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_rank() -> int:
    """RANK from torchrun's environment (0 when not launched by torchrun): still known after the process
    group is gone."""
    return int(os.environ.get("RANK", "0"))


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


def seed_rank(seed: int) -> None:
    """Give each rank its own sampling RNG streams (`rank_seed`)."""
    offset = rank_seed(seed, rank())
    torch.manual_seed(offset)
    random.seed(offset)
    np.random.seed(offset % 2**32)
