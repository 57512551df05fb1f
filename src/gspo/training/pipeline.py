"""Rollout batches sampled ahead of the updates (rollout.lag = k, docs/async.md).

Batch b (the one step b trains on) is drawn, and rewarded, from the weights of version v(b) = max(0, b - 1 -
k): after the update that makes version s, batch s + k + 1 is handed to the sampling side with a copy of
those weights, and the trainer goes on with batch s + 1, drawn earlier. With k = 0 that is the synchronous
loop: batch s + 1 is drawn, in this thread, right after update s. With k > 0 a worker thread draws from its
own copy of the model (or syncs its engine to that copy), so slow sampling and rewards overlap the updates.

The schedule alone decides which version draws which batch, and every batch's sampling seed is
`gspo.core.seeds.sample_seed` of its step (and rank): a run is reproducible from its seed at any k, whatever
the threads' timing. `state` gives what a checkpoint keeps: the batches drawn ahead (those of steps up to
s + k, waited for) and the prompt stream's position before the first batch it does not keep, which a
resumed run draws again from the same weights and seed.
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gspo.config import Config, ConfigError
from gspo.learning.policy import Policy
from gspo.parallel.group import world_size
from gspo.rollout.data import PromptStream
from gspo.sampling.batches import Drawn, Request


@dataclass
class Pipeline:
    """The batches of the steps ahead (module docstring). `make_request(step, version)` takes the step's
    prompts from the stream; `draw_batch(request)` draws them, in this thread when ``lag`` is 0, else in one
    worker thread over ``worker_model``, a copy of the policy whose trainable weights each request's
    snapshot replaces before ``sync`` hands them to the engine."""

    lag: int
    stream: PromptStream
    make_request: Callable[[int, int], Request]
    draw_batch: Callable[[Request], Drawn]
    worker_model: torch.nn.Module | None = None
    sync: Callable[[torch.nn.Module, int], None] | None = None
    last_step: int | None = None
    """No batch beyond it is drawn (train.steps)."""
    kept: list[Drawn] = field(default_factory=list)
    """Batches a checkpoint kept, trained before any is drawn."""
    ahead: dict[int, concurrent.futures.Future[Drawn] | Drawn | Request] = field(default_factory=dict)
    """Each step ahead: its batch drawn (kept by a checkpoint), being drawn (a future), or, with lag 0, the
    request drawn when the step asks for it."""
    stream_before: dict[int, dict[str, Any]] = field(default_factory=dict)
    _executor: concurrent.futures.ThreadPoolExecutor | None = None
    _started: bool = False

    def __post_init__(self) -> None:
        if self.lag > 0:
            assert self.worker_model is not None and self.sync is not None
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gspo-sampling")

    def _start(self, step: int) -> None:
        """Begin at ``step`` (updates done) with the batches a checkpoint kept: the rest of steps step + 1 ..
        step + lag + 1 is drawn from the current weights (version ``step``), as the schedule says."""
        self._started = True
        for drawn in self.kept:
            self.ahead[drawn.step] = drawn
        for b in range(step + 1, step + self.lag + 2):
            if b not in self.ahead:
                self.submit(b, step, weights=None)

    def submit(self, step: int, version: int, weights: list[torch.Tensor] | None) -> None:
        """Hand batch ``step`` to the sampling side, drawn from version ``version``: ``weights``, a copy of
        its trainable parameters (None: the worker's copy already holds them)."""
        if self.last_step is not None and step > self.last_step:
            return
        self.stream_before[step] = self.stream.state_dict()
        request = self.make_request(step, version)
        if self._executor is None:  # drawn when the step asks for it, in this thread
            self.ahead[step] = request
            return
        self.ahead[step] = self._executor.submit(self._work, request, weights)

    def _work(self, request: Request, weights: list[torch.Tensor] | None) -> Drawn:
        if weights is not None:
            assert self.worker_model is not None and self.sync is not None
            params = [p for p in self.worker_model.parameters() if p.requires_grad]
            with torch.no_grad():
                torch._foreach_copy_(params, weights)
            self.sync(self.worker_model, request.version)
        return self.draw_batch(request)

    def updated(self, model: torch.nn.Module, version: int) -> None:
        """The training side made ``version``: batch version + lag + 1 is drawn from it."""
        if not self._started:  # a step trained outside the pipeline (the user's trajectories)
            return
        for done in [b for b in self.stream_before if b <= version]:
            del self.stream_before[done]
        weights = None
        if self._executor is not None:
            with torch.no_grad():
                weights = [p.detach().clone() for p in model.parameters() if p.requires_grad]
        self.submit(version + self.lag + 1, version, weights)

    def next(self, step: int) -> Drawn:
        """Batch ``step``, waiting for it; a sampling-side error (a server that died) is raised here."""
        if not self._started:
            self._start(step - 1)
        pending = self.ahead.pop(step)
        if isinstance(pending, Drawn):
            return pending
        if isinstance(pending, Request):
            return self.draw_batch(pending)
        return pending.result()

    def state(self, step: int) -> dict[str, Any]:
        """What a checkpoint at ``step`` keeps: the batches of steps step + 1 .. step + lag (waited for),
        those up to the first that failed, and the stream's position before the first batch not kept."""
        if not self._started:
            return {"ahead": [drawn.state() for drawn in self.kept], "stream": self.stream.state_dict()}
        kept = []
        for b in range(step + 1, step + self.lag + 1):
            pending = self.ahead.get(b)
            if pending is None or isinstance(pending, Request):
                break
            try:
                drawn = pending if isinstance(pending, Drawn) else pending.result()
            except Exception:  # the error is raised when the step asks for it; the checkpoint stops here
                break
            if drawn.failure is not None:
                break
            kept.append(drawn.state())
        first = step + 1 + len(kept)
        stream = self.stream_before.get(first, self.stream.state_dict())
        return {"ahead": kept, "stream": stream}

    def close(self) -> None:
        """Stop the worker after the batch it is drawing (none is trained: the run ends or stops)."""
        if self._executor is not None:
            for pending in self.ahead.values():
                if isinstance(pending, concurrent.futures.Future):
                    pending.cancel()
            self._executor.shutdown(wait=True)
            self._executor = None


def sampling_side(config: Config, policy: Policy) -> Policy:
    """The policy the sampling side draws from with rollout.lag > 0: a copy of the model (in memory of its
    own), without optimizer duties. FSDP2 shards the model across ranks, which a copy per rank cannot
    sample from: refused."""
    if config.distributed.wrapper == "fsdp2" and world_size() > 1:
        raise ConfigError(
            f"rollout.lag={config.rollout.lag} keeps a copy of the whole model per rank to sample from, and "
            "distributed.wrapper=fsdp2 shards it: set distributed.wrapper=ddp, or rollout.lag=0"
        )
    return dataclasses.replace(policy, model=copy.deepcopy(policy.model), scorer=None, reference=None)
