"""The server's trainer: one train call at a time on the live policy, the sampling weights kept in step,
every acknowledged step on disk.

A train call (gspo.serve.updates) waits for the one before it, then, with serve.during_update=wait, stops
admitting samples and waits for the running ones to finish; with "stale" sampling goes on from its own copy
of the weights. After the updates the policy version goes up by one, the step's metrics go to
metrics.jsonl, and (serve.durable) a checkpoint is written before the answer, so a kill after an answer
loses nothing it acknowledged; then the sampling weights take the new ones. A failed update or checkpoint
puts the policy back as it was. `--resume` restores weights, optimizer, schedule, RNG and the version.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gspo.run.start import Run, run_attribute
from gspo.sampling.side import SamplingSide
from gspo.serve.protocol import ServeError, TrainRequest
from gspo.serve.records import RecordStore
from gspo.serve.updates import Snapshot, completion_rows, prepare_update, resolve, run_update

REMEMBERED_CALLS = 64
"""Train calls whose answers are kept (and checkpointed) by request_id, so a retried call is not applied twice."""


def request_digest(request: TrainRequest) -> str:
    """The sha256 of a train call's body without its request_id: what a repeated id must repeat."""
    body = request.model_dump(mode="json", exclude={"request_id"})
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


@dataclass
class TrainService:
    """Train calls on the live policy of `run` (module docstring), whose step is the policy version; `side`
    samples, from the policy's own weights (during_update=wait) or a copy (stale), and takes each new version
    through its one road (SamplingSide.updated). `answers`: the last train calls' answers by request_id,
    restored from a checkpoint."""

    run: Run
    side: SamplingSide
    records: RecordStore
    answers: dict[str, Any] = field(default_factory=dict)
    state: str = "idle"
    calls: int = 0
    saved_version: int = 0
    last_error: str | None = None
    last_metrics: dict[str, float] = field(default_factory=dict)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        self.snapshot = Snapshot(self.policy)
        self.answers = collections.OrderedDict(self.answers)
        self.saved_version = self.version

    config = run_attribute("config", via="run")
    policy = run_attribute("policy", via="run")
    spec = run_attribute("spec", via="run")
    run_dir = run_attribute("path", via="run")
    logger = run_attribute("logger", via="run")  # opened by Run.restore
    version = run_attribute("step", via="run", settable=True)  # train calls applied: the run's step

    async def train(self, request: TrainRequest) -> dict[str, Any]:
        if request.request_id is not None and request.request_id in self.answers:
            return self._repeated(request)
        serve = self.config.serve
        resolve(request, self.records, self.version, serve.max_staleness)  # refuse at once what cannot train
        try:
            await asyncio.wait_for(self._lock.acquire(), serve.train_timeout)
        except TimeoutError:
            raise ServeError(
                503, "another train call ran longer than serve.train_timeout", code="busy"
            ) from None
        try:
            if request.request_id is not None and request.request_id in self.answers:
                return self._repeated(request)
            rebuilt = resolve(request, self.records, self.version, serve.max_staleness)  # versions moved?
            update = prepare_update(request, rebuilt, self.config, self.policy, self.spec, self.version)
            rows = completion_rows(request, rebuilt, self.run.tokenizer, self.config.completions_per_step)
            return await self._apply(request, update, rows)
        finally:
            self.state = "idle"
            self._lock.release()

    async def _apply(self, request: TrainRequest, update: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
        wait = self.config.serve.during_update == "wait"
        t0 = time.perf_counter()
        if wait:
            self.state = "waiting for the running samples"
            try:
                await self.side.driver.pause(self.config.serve.request_timeout)
            except TimeoutError as error:
                raise ServeError(503, f"could not start the update: {error}", code="busy") from None
        try:
            self.state = "training"
            t1 = time.perf_counter()
            try:
                metrics = await self.run.workers.in_thread(
                    lambda: run_update(self.policy, update, self.snapshot), stage="train"
                )
            except Exception as error:
                raise self._failed("the update", error) from error
            metrics |= {"time_wait_samples": t1 - t0, "time_train": time.perf_counter() - t1}
            metrics["lr"] = self.policy.scheduler.get_last_lr()[0]
            answer = {
                "object": "train",
                "version": self.version + 1,
                "metrics": metrics,
                "split_trajectories": update.split,
                "old_logprobs": update.spec.old_logprobs,
                "checkpoint": None,
                "request_id": request.request_id,
                "request_sha256": request_digest(request),
            }
            path = await self._record_step(metrics, request.request_id, answer, rows)
            for record in update.completions:  # the step is taken: none of them trains again
                record.trained_in = self.version
            answer["checkpoint"] = str(path) if path is not None else None
            await self._publish()
        finally:
            if wait:
                self.side.driver.resume()
        self.calls += 1
        return answer

    def _repeated(self, request: TrainRequest) -> dict[str, Any]:
        """The stored answer of the call that used this request_id, when this call is that one again; a
        409 when its body differs: its groups were not trained, and the client must hear it."""
        answer = self.answers[request.request_id]
        digest = answer.get("request_sha256")  # absent in answers checkpointed before digests
        if digest is not None and digest != request_digest(request):
            raise ServeError(
                409,
                f"request_id {request.request_id!r} was used by another train call (policy version "
                f"{answer['version']}) with other groups: these groups were not trained; send them under a "
                "new request_id",
                param="request_id",
                code="request_id_reused",
            )
        return answer | {"repeated": True}

    def _failed(self, what: str, error: BaseException) -> ServeError:
        self.last_error = f"{what} failed: {type(error).__name__}: {error}"
        return ServeError(
            500,
            f"{self.last_error}; the weights, optimizer and schedule are as they were (policy version {self.version})",
            code="update_failed",
        )

    async def _record_step(
        self,
        metrics: dict[str, float],
        request_id: str | None,
        answer: dict[str, Any],
        rows: list[dict[str, Any]],
    ) -> Path | None:
        """Version + 1, its metrics and completions logged, its answer remembered, and (durable) its
        checkpoint on disk; a checkpoint that fails undoes the step."""
        self.version += 1
        self.last_metrics = metrics
        self.logger.log(self.version, metrics)
        self.logger.log_samples(self.version, [{"step": self.version, **row} for row in rows])
        self._remember(request_id, answer)  # before the checkpoint, which keeps it
        every = self.config.checkpoint.every
        if not (self.config.serve.durable or (every and self.version % every == 0)):
            return None
        self.state = "checkpointing"
        t0 = time.perf_counter()
        try:
            path = await self.run.workers.in_thread(self._save, stage="train")
        except Exception as error:
            self.snapshot.restore()
            self.version -= 1
            self.answers.pop(request_id, None)
            raise self._failed("the checkpoint", error) from error
        metrics["time_checkpoint"] = time.perf_counter() - t0
        return path

    def _save(self) -> Path:
        """A checkpoint of this version (`gspo train`'s kind) with the last train calls' answers."""
        path = self.run.save(serve={"version": self.version, "answers": dict(self.answers)})
        assert path is not None  # one process
        self.saved_version = self.version
        return path

    async def _publish(self) -> None:
        """The sampling side takes the new weights and version, between two of its engine's steps."""
        await asyncio.wrap_future(self.side.updated(self.policy.model, self.version, settled=True))

    def _remember(self, request_id: str | None, answer: dict[str, Any]) -> None:
        if request_id is None:
            return
        self.answers[request_id] = answer
        while len(self.answers) > REMEMBERED_CALLS:
            self.answers.popitem(last=False)

    async def checkpoint(self) -> Path:
        """A checkpoint of the current version now (POST /v1/checkpoint; at shutdown when not durable)."""
        async with self._lock:
            self.state = "checkpointing"
            try:
                return await self.run.workers.in_thread(self._save, stage="train")
            finally:
                self.state = "idle"

    def status(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "state": self.state,
            "train_calls": self.calls,
            "checkpointed_version": self.saved_version,
            "last_error": self.last_error,
            "last_metrics": self.last_metrics,
            "run_dir": str(self.run_dir),
        }
