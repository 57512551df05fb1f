"""Peak memory per rank and time per update of one long row, split across 1, 2 and 4 CPU ranks (gloo).

One sequence of ``--tokens`` tokens (a 64-token prompt, the rest completion) is trained by gspo's learner
(`learn`: the old-policy pass, then one optimizer update, ``train.minibatches=1``) with
``distributed.sequence_parallel=N`` on N processes, the tiny Llama of configs/tiny.yaml (GSPO, fp32).
Rank 0 holds the sequence, as its rollouts would; the group pools it and each rank computes 1/N of the row.

Memory, per rank, two measures. Peak: every page the pass and the update touched, VmHWM - VmRSS after
the kernel's peak-RSS mark is reset (``/proc/self/clear_refs``, as benchmarks/logprob_memory.py, after
glibc's malloc_trim hands freed heap pages back; ru_maxrss where clear_refs is not writable), measured
after a warm-up update on the same row (AdamW state and the first gradients exist). Activations,
gathered keys and values, the head's chunks, the parameters' gradients, and heap pages glibc keeps after
a free all count. Saved: the peak bytes of the distinct storages autograd holds for the backward during
the update (`SavedForBackward`: the activations, parameters left out). glibc's own choices move the
peak: with ``MALLOC_MMAP_THRESHOLD_=131072`` in the environment (the workers inherit it) large blocks
are always mapped and returned on free, as they are by default until a free raises the threshold.
Time: the learner's ``time_update`` (one forward, backward and step) and the process CPU seconds of the
update on each rank, medians of ``--repeats`` (memory: their largest); on a machine with fewer cores
than ranks, the wall-clock time cannot shrink with N, the CPU seconds per rank show the work each rank
does.

    HF_HUB_OFFLINE=1 python benchmarks/sequence_parallel.py --tokens 8192 --ranks 1,2,4 --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import resource
import socket
import statistics
import tempfile
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import StorageWeakRef

ROOT = Path(__file__).resolve().parent.parent
PROMPT = 64


def _proc_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> bool:
    """Return freed heap pages to the kernel (glibc keeps them, and a later update would reuse them
    unseen), then reset the peak-RSS mark to the current RSS."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class SavedForBackward:
    """The peak bytes of the distinct storages that autograd holds for the backward (activations; the
    parameters left out), entered around each optimizer update (`learn`'s ``around_update``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        self.live = {ptr: ref for ptr, ref in self.live.items() if not ref[0].expired()}
        if storage.data_ptr() not in self.parameters:
            self.live.setdefault(storage.data_ptr(), (StorageWeakRef(storage), storage.nbytes()))
        self.peak = max(self.peak, sum(nbytes for _, nbytes in self.live.values()))
        return tensor

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
            yield


def _trainer(run_dir: Path, tokens: int, ranks: int):
    from gspo.config import load_config
    from gspo.training.trainer import Trainer

    overrides = [
        f"output_dir={run_dir}",
        "report_to=[]",
        "progress=false",
        "eval.every=0",
        "train.objective=gspo",
        "train.layout=packed",
        f"train.pack_length={tokens}",
        f"train.micro_batch_tokens={tokens}",
        "train.minibatches=1",
        "train.old_logprobs=recompute",
        "train.mixed_precision=none",
        f"rollout.prompts_per_step={4 * ranks}",
        f"distributed.sequence_parallel={ranks}",
    ]
    return Trainer(load_config(ROOT / "configs" / "tiny.yaml", overrides))


def _batch(tokens: int, mine: bool):
    from gspo.core.layout import TokenSequence
    from gspo.learning.batch import Batch

    if not mine:
        return Batch([], torch.zeros(0), [], [])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 90, (tokens,), generator=g).tolist()
    completion = tokens - PROMPT
    return Batch(
        [TokenSequence(ids[:PROMPT], ids[PROMPT:], [True] * completion)],
        torch.ones(1),
        [[-4.0] * completion],
        [0],
    )


def _worker(rank: int, ranks: int, port: int, tokens: int, repeats: int, out: Path) -> None:
    from gspo.learning.learner import learn

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HF_HUB_OFFLINE="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ranks, timeout=timedelta(minutes=10))
    trainer = _trainer(out / "run", tokens, ranks)
    batch = _batch(tokens, rank == 0)
    learn(trainer.policy, trainer.spec, batch, seed=0)  # warm-up: optimizer state, first gradients
    peaks, saved, walls, cpus = [], [], [], []
    for repeat in range(repeats):
        dist.barrier()
        how = "VmHWM - VmRSS" if _reset_peak() else "ru_maxrss - VmRSS"
        before = _proc_bytes("VmRSS")
        cpu = time.process_time()
        saved_for_backward = SavedForBackward(trainer.policy.model)
        metrics = learn(
            trainer.policy, trainer.spec, batch, seed=1 + repeat, around_update=saved_for_backward
        )
        cpus.append(time.process_time() - cpu)
        hwm = (
            _proc_bytes("VmHWM")
            if how.startswith("VmHWM")
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        )
        peaks.append(hwm - before)
        saved.append(saved_for_backward.peak)
        walls.append(metrics["time_update"])
    result = {
        "peak_mib": max(peaks) / 2**20,
        "saved_mib": max(saved) / 2**20,
        "update_s": statistics.median(walls),
        "cpu_s": statistics.median(cpus),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result | {"how": how}))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(ranks: int, tokens: int, repeats: int) -> list[dict]:
    """Each rank's peak MiB, median update seconds and CPU seconds (learn() incl. the old-policy pass)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        mp.start_processes(
            _worker, args=(ranks, _free_port(), tokens, repeats, out), nprocs=ranks, start_method="spawn"
        )
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="the row's length (a multiple of 4)")
    parser.add_argument("--ranks", default="1,2,4", help="group sizes to measure, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print(
        f"{args.tokens}-token row, tiny Llama, fp32; CPU: {_cpu_name()}, {os.cpu_count()} cores, load "
        f"{os.getloadavg()}; MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', 'unset')}"
    )
    base = None
    print(
        f"{'ranks':>5} {'peak MiB/rank (max)':>20} {'ratio':>6} {'saved MiB/rank (max)':>21} {'ratio':>6} "
        f"{'update s (rank 0)':>18} {'CPU s/rank (max)':>17} {'ratio':>6}"
    )
    for ranks in (int(r) for r in args.ranks.split(",")):
        per_rank = measure(ranks, args.tokens, args.repeats)
        peak, saved, cpu = (max(r[key] for r in per_rank) for key in ("peak_mib", "saved_mib", "cpu_s"))
        base = base or (peak, saved, cpu)
        print(
            f"{ranks:>5} {peak:>20.1f} {peak / base[0]:>6.2f} {saved:>21.1f} {saved / base[1]:>6.2f} "
            f"{per_rank[0]['update_s']:>18.2f} {cpu:>17.2f} {cpu / base[2]:>6.2f}"
        )
        for key in ("peak_mib", "saved_mib"):
            print(f"      {key} per rank: {[round(r[key], 1) for r in per_rank]}")
    print(f"peak measured as {per_rank[0]['how']}; load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
