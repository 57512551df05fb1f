"""Training runs of a study: one config each, trained in parallel processes, resumable, timed.

A run is a list of `gspo train` overrides of the default config. A finished run (its latest checkpoint at
train.steps: the trainer always checkpoints the last step) is not trained again, an interrupted one resumes
from its latest checkpoint: a study started again with the same arguments continues where it stopped and,
once every run is done, only summarises and reports.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gspo.config import load_config
from gspo.run.checkpoint import latest_checkpoint, load_trainer_state
from gspo.training.trainer import Trainer


@dataclass(frozen=True)
class Job:
    """One run: its config as overrides of the default config (output_dir among them), and its threads."""

    overrides: tuple[str, ...]
    threads: int = 1


@dataclass(frozen=True)
class Done:
    """What one invocation spent on a run: steps trained now (0: finished before), wall and CPU seconds
    (this process's CPU time: on a busy machine the wall time overstates what the run costs)."""

    run: str
    steps: int
    wall: float
    cpu: float


def train_one(job: Job) -> Done:
    """Train one run to its train.steps: resumes an interrupted run, skips a finished one."""
    torch.set_num_threads(job.threads)
    config = load_config(None, list(job.overrides))
    run_dir = Path(config.output_dir)
    checkpoint = latest_checkpoint(run_dir)
    start = load_trainer_state(checkpoint)["step"] if checkpoint is not None else 0
    t0, c0 = time.perf_counter(), time.process_time()
    if start < config.train.steps:
        Trainer(config, resume=run_dir if checkpoint is not None else None).run()
    return Done(run_dir.name, config.train.steps - start, time.perf_counter() - t0, time.process_time() - c0)


def train_all(jobs: list[Job], workers: int) -> list[Done]:
    """Every job, ``workers`` at a time in spawned processes (one process per run), printing each as done."""
    done = []
    with contextlib.ExitStack() as stack:
        if workers == 1:
            results = map(train_one, jobs)
        else:
            pool = stack.enter_context(multiprocessing.get_context("spawn").Pool(workers, maxtasksperchild=1))
            results = pool.imap_unordered(train_one, jobs)
        for r in results:
            done.append(r)
            print(f"{r.run}: {r.steps} steps, {r.wall:.0f} s wall, {r.cpu:.0f} s CPU", flush=True)
    return done


def threads_per_worker(workers: int) -> int:
    """Each parallel run's share of the threads (tiny models: processes scale better than threads)."""
    return max(1, torch.get_num_threads() // workers)


@dataclass(frozen=True)
class Cost:
    """What an invocation cost, for a report's Cost section."""

    total_seconds: float
    workers: int
    threads: int
    runs: int
    steps_trained: int
    cpu_seconds: float
    wall_per_step: float
    cpu_per_step: float

    @classmethod
    def of(cls, done: list[Done], started: float, workers: int, threads: int) -> Cost:
        """The cost of the runs ``done`` by an invocation that began at perf_counter() ``started``."""
        trained = sum(r.steps for r in done)
        return cls(
            total_seconds=time.perf_counter() - started,
            workers=workers,
            threads=threads,
            runs=len(done),
            steps_trained=trained,
            cpu_seconds=sum(r.cpu for r in done),
            wall_per_step=sum(r.wall for r in done) / max(1, trained),
            cpu_per_step=sum(r.cpu for r in done) / max(1, trained),
        )


class LoadMonitor(threading.Thread):
    """Samples the 1-minute load average every `every` seconds: how busy the machine was during the run."""

    def __init__(self, every: float = 30.0) -> None:
        super().__init__(daemon=True)
        self.every, self.samples, self.stop = every, [os.getloadavg()[0]], threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.every):
            self.samples.append(os.getloadavg()[0])

    def sentence(self) -> str:
        """The load over the run, for a report: the last sample, and the sampling stops."""
        self.stop.set()
        self.samples.append(os.getloadavg()[0])
        mean_load = sum(self.samples) / len(self.samples)
        cores = os.cpu_count() or 1
        busy = (
            f"above the {cores} cores, so other processes shared the CPU and the wall time is longer than on an "
            "idle machine"
            if mean_load > cores
            else "the machine was otherwise about idle"
        )
        return (
            f"The machine's 1-minute load average, sampled every {self.every:.0f} s, averaged {mean_load:.1f} "
            f"(max {max(self.samples):.1f}) on {cores} cores: {busy}. "
        )
