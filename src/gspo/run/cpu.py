"""CPU threads of a run's helper threads: one OpenMP and one MKL thread each, so the trainer's thread keeps
the process's one OpenMP team.

Every thread that runs a parallel torch op gets an OpenMP team of its own, which lives as long as the thread.
Once libgomp manages more threads than there are CPUs, it throttles every team's spin before sleeping (about
100 spins instead of 300,000: GOMP_SPINCOUNT cannot raise it), so each fork and join of the trainer's team
goes through the kernel: the update phase ran 1.6x slower per operator beside a sampling thread
(benchmarks/update_threads.py; docs/async.md). `one_cpu_thread` sets the calling thread's own OpenMP
(libgomp's omp_set_num_threads, per thread) and MKL (MKL_Set_Num_Threads_Local) thread counts to one, so its
ops make no team; torch.set_num_threads would change the trainer's too (MKL's count is process-wide).
"""

from __future__ import annotations

import ctypes
import functools
import sys
from pathlib import Path


@functools.cache
def _libraries() -> tuple[ctypes.CDLL, ctypes.CDLL] | None:
    """torch's own libgomp and libtorch_cpu (MKL's symbols), as the wheel ships them; None elsewhere (another
    build: its threads are left as they are)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    lib = Path(torch.__file__).parent / "lib"
    try:
        gomp = ctypes.CDLL(str(lib / "libgomp.so.1"))
        cpu = ctypes.CDLL(str(lib / "libtorch_cpu.so"))
        # MKL's C entry point (by value); the wheel's lower-case mkl_set_num_threads_local is the Fortran
        # one, which takes a pointer
        local = cpu.MKL_Set_Num_Threads_Local
        gomp.omp_set_num_threads  # noqa: B018 (present)
    except (OSError, AttributeError):
        return None
    local.argtypes, local.restype = [ctypes.c_int], ctypes.c_int
    gomp.omp_set_num_threads.argtypes, gomp.omp_set_num_threads.restype = [ctypes.c_int], None
    return gomp, cpu


def one_cpu_thread() -> bool:
    """The calling thread's torch ops run on one CPU thread from now on (module docstring); whether they do
    (False: torch is not loaded, or not the wheel's build with GNU OpenMP and MKL)."""
    found = _libraries()
    if found is None:
        return False
    gomp, cpu = found
    gomp.omp_set_num_threads(1)
    cpu.MKL_Set_Num_Threads_Local(1)
    return True
