"""The sampling side of a run, for `gspo train` at every rollout.lag and for `gspo serve`: the one owner of the
sampler (built from gspo.config.engines' registry), the weights it samples from, its tokenizer, its thread
and the version of its weights.

- **Weights.** In line with the updates (`gspo train` at lag 0, `gspo serve` waiting for its updates) the
  sampler samples from the policy itself. Beside them (lag > 0, serve.during_update=stale) it samples from a
  copy of its own, so the updates never change weights under a sample being drawn.
- **One road for new weights.** `updated(model, version)` takes the trainable weights (beside the updates: a
  snapshot, at once) and hands them to the sampler in its own turn (`Sampler.sync_weights`), then the
  version goes up; nothing else gives the sampler weights.
- **One turn.** Everything that touches the sampler runs in the side's turn, in the order it was asked:
  draws and weight syncs as calls (`call`, a future each). Beside the updates that turn is a thread of the
  run's (a gspo.workers.Stage, whose torch ops run on one CPU thread: gspo.run.cpu); serving, it is the
  streaming engine's thread (gspo.sampling.driver.Driver), which steps the engine between calls. In line
  with the updates there is no thread: a call runs in the thread that asks for its result
  (gspo.workers.InPlace), and a weight sync at once. The one model keeps the order of draws and syncs that
  the schedule needs (gspo.sampling.schedule) and the server's rule that a sample never straddles two
  weight syncs.
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import nn

from gspo.config import Config
from gspo.learning.policy import Policy
from gspo.learning.weights import copy_weights
from gspo.rollout.data import Example
from gspo.rollout.samplers import Sampler
from gspo.run.cpu import one_cpu_thread
from gspo.run.start import Run
from gspo.sampling.driver import Driver
from gspo.sampling.factories import build_sampler, sampler_is_current
from gspo.workers import InPlace, Stage

T = TypeVar("T")


@dataclass
class SamplingSide:
    """A run's sampler and what it owns (module docstring). ``beside``: it samples from ``model``, a copy of
    the policy's of its own; ``turn``: where its calls run (a thread of the run's, the serving engine's
    `driver`, or in place)."""

    sampler: Sampler
    model: nn.Module
    tokenizer: Any
    version: int
    beside: bool
    turn: Stage | InPlace | None
    """Where its calls run: a thread of the run's, or in place; None: the serving `driver`'s thread."""
    driver: Driver | None = None
    """The streaming engine's thread, serving."""
    failure: BaseException | None = None
    """A weight sync's error: the sampler holds no known weights since."""

    @classmethod
    def open(
        cls,
        run: Run,
        *,
        beside: bool,
        threaded: bool,
        sampler: Sampler | None = None,
        engine: Callable[[Sampler], Any] | None = None,
    ) -> SamplingSide:
        """The sampling side of ``run``'s policy, at its step's version: ``sampler`` (None: the one
        rollout.engine names), drawing from the policy's own weights or, ``beside`` the updates, from a copy
        (with its own tokenizer: a tokenizer is not to be shared between threads); ``threaded``: a thread of
        its own, which steps ``engine(sampler)`` (a streaming engine, `gspo serve`) between its calls."""
        policy, tokenizer = run.policy, run.tokenizer
        if beside:  # a copy in memory of its own, without optimizer duties
            policy = dataclasses.replace(
                policy, model=copy.deepcopy(policy.model), scorer=None, reference=None
            )
            tokenizer = copy.deepcopy(tokenizer)
        sampler = sampler or build_sampler(run.config, policy, tokenizer, run.path)
        driver, turn = None, InPlace()
        if engine is not None:  # serving: the engine's thread is the side's turn
            driver = Driver(lambda: engine(sampler), run.workers, max_waiting=run.config.serve.max_waiting)
            driver.version = run.step
            turn = None
        elif threaded:
            turn = run.workers.stage("sampling", on_start=one_cpu_thread)
        return cls(sampler, policy.model, tokenizer, run.step, beside, turn, driver)

    @property
    def threaded(self) -> bool:
        """Whether its calls run in a thread of their own."""
        return not isinstance(self.turn, InPlace)

    def current(self, config: Config, policy: Policy, probe: list[Example]) -> bool:
        """Whether its samples' log-probs are the current weights' own (measured on the ``probe`` prompts
        where they may not be: gspo.sampling.factories.sampler_is_current)."""
        return sampler_is_current(config, self.sampler, policy, probe)

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` in the side's turn, after what was asked before it; its future holds the result or the
        error. Once a weight sync has failed, every later call fails with its error: nothing is drawn from
        weights the sampler did not take."""

        def guarded() -> T:
            if self.failure is not None:
                raise self.failure
            return fn()

        if self.turn is None:
            return self.driver.between_steps(guarded)
        return self.turn.submit(guarded)

    def updated(
        self, model: nn.Module, version: int, *, settled: bool = False
    ) -> concurrent.futures.Future[None]:
        """``model``'s trainable weights are version ``version``: the sampler takes them, in its turn. Beside the
        updates they are copied now (a snapshot), unless ``settled``: the caller changes nothing until the
        returned future is done (`gspo serve` awaits it)."""
        weights = copy_weights(model) if self.beside and not settled else None
        source = model

        def take() -> None:
            if self.beside:
                copy_weights(weights if weights is not None else source, into=self.model)
            try:
                self.sampler.sync_weights(self.model, self.tokenizer, version)
            except BaseException as error:
                self.failure = error
                raise
            self.version = version
            if self.driver is not None:  # no prompt computed with the old weights is reused
                self.driver.engine.reset_prefix_cache()
                self.driver.version = version

        future = self.call(take)
        if not self.threaded:  # in line with the updates: taken now, its error raised here
            future.result()
        return future

    def close(self, timeout: float | None = None) -> None:
        """Stop its thread: what it runs ends first (``timeout``: waiting at most that many seconds), what
        waits is cancelled. A server the sampler started stops with the process."""
        if self.driver is not None:
            self.driver.close(timeout)
        if self.turn is not None:
            self.turn.close(timeout)
