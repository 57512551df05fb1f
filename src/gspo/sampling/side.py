"""The sampling side of a run, for `gspo train` at every rollout.lag and for `gspo serve`: the one owner of the
sampler (built from gspo.config.engines' registry), the weights it samples from, its tokenizer, its thread
and the version of its weights.

- **Weights.** In line with the updates (`gspo train` at lag 0, `gspo serve` waiting for its updates) the
  sampler samples from the policy itself. Beside them (lag > 0, serve.during_update=stale) it samples from a
  copy of its own, so the updates never change weights under a sample being drawn.
- **One road for new weights.** `updated(model, version)` takes the trainable weights (beside the updates: a
  snapshot, at once) and hands them to the sampler in its own turn (`Sampler.sync_weights`), then the
  version goes up; nothing else gives the sampler weights.
- **One thread.** Beside the updates, or serving, one thread (gspo.sampling.driver.Driver) runs everything
  that touches the sampler, in the order it was asked: draws and weight syncs as calls (`call`, a future
  each), and, serving, the streaming engine's steps between them. In line with the updates there is no
  thread: `call` runs at once. The one model keeps the order of draws and syncs that the schedule needs
  (gspo.sampling.schedule) and the server's rule that a sample never straddles two weight syncs.
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
from gspo.run.start import Run
from gspo.sampling.driver import Driver
from gspo.sampling.factories import build_sampler, sampler_is_current

T = TypeVar("T")


@dataclass
class SamplingSide:
    """A run's sampler and what it owns (module docstring). ``beside``: it samples from ``model``, a copy of
    the policy's of its own; ``driver``: its thread (None: calls run at once, in the caller's thread)."""

    sampler: Sampler
    model: nn.Module
    tokenizer: Any
    version: int
    beside: bool
    driver: Driver | None = None
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
        driver = None
        if threaded:
            factory = (lambda: engine(sampler)) if engine is not None else None
            driver = Driver(factory, max_waiting=run.config.serve.max_waiting)
            driver.version = run.step
        return cls(sampler, policy.model, tokenizer, run.step, beside, driver)

    def current(self, config: Config, policy: Policy, probe: list[Example]) -> bool:
        """Whether its samples' log-probs are the current weights' own (measured on the ``probe`` prompts
        where they may not be: gspo.sampling.factories.sampler_is_current)."""
        return sampler_is_current(config, self.sampler, policy, probe)

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` in the side's turn: in its thread after what was asked before it (its future holds the
        result or the error), or now (no thread: an error is raised here). Once a weight sync has failed,
        every later call fails with its error: nothing is drawn from weights the sampler did not take."""

        def guarded() -> T:
            if self.failure is not None:
                raise self.failure
            return fn()

        if self.driver is not None:
            return self.driver.between_steps(guarded)
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        future.set_result(guarded())
        return future

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

        return self.call(take)

    def close(self, timeout: float | None = None) -> None:
        """Stop the thread: what it runs ends first (``timeout``: waiting at most that many seconds), what
        waits is cancelled. A server the sampler started stops with the process."""
        if self.driver is not None:
            self.driver.close(timeout)
