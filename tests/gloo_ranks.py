"""Runs a test module's ``SCENARIOS`` on ``world`` gloo ranks on the CPU, in spawned processes, once.

Each scenario is ``fn(rank, out) -> value``. Every rank runs all of them in turn on one process group and
saves, after each, what it has (``out/rank{r}.pt``: name -> {"value" or "traceback", "seconds"}), so a
scenario that fails records its traceback instead of stopping the others, and what is done survives a
later hang; a hung collective hits the group's 60 s timeout, a hung process the deadline.
"""

from __future__ import annotations

import importlib
import os
import socket
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, port: int, out: Path, module: str, world: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HF_HUB_OFFLINE="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    results: dict[str, Any] = {}
    for name, scenario in importlib.import_module(module).SCENARIOS.items():
        start = time.perf_counter()
        try:
            results[name] = {"value": scenario(rank, out)}
        except Exception:
            results[name] = {"traceback": traceback.format_exc()}
        results[name]["seconds"] = time.perf_counter() - start
        torch.save(results, out / f"rank{rank}.pt")  # what is done survives a later hang
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(module: str, world: int, out: Path, deadline_s: float) -> list[dict[str, Any]]:
    """Each rank's results of module ``module``'s SCENARIOS (the test module's ``__name__``)."""
    context = mp.start_processes(
        _worker, args=(_free_port(), out, module, world), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + deadline_s
    while not context.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {world} workers did not finish within {deadline_s} s")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def result(runs: list[dict[str, Any]], name: str) -> list[Any]:
    """Scenario ``name``'s value on each rank; a rank's traceback fails the test."""
    for rank, ran in enumerate(runs):
        assert "traceback" not in ran[name], f"rank {rank}, {name}:\n{ran[name]['traceback']}"
    return [ran[name]["value"] for ran in runs]
