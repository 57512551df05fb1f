"""The sampling side's thread (gspo.sampling.side): it runs the calls it is handed (draws, weight syncs), in
order, and between them steps a streaming engine for `gspo serve` (gspo's own, gspo.rollout.hf_engine, or
vLLM's), the one place the server touches an engine.

asyncio handlers `submit` a request's prompts and read its samples' tokens from a `Handle`'s queue as each
engine step draws them (tokens can be streamed at once), or with `at_end` all at once when its samples have
ended; `cancel` frees a request's slots at the next step (a client that went away). The driver thread is the
only caller of `Engine.step`; it sleeps while there is no work. Between two steps it runs the calls the
server queues with `between_steps` (e.g. copying new weights into the sampling model, then
`reset_prefix_cache`). `pause` stops admitting new requests and waits until the running ones have finished
(the engine is idle), so the weights can change with no sample straddling two versions; `resume` admits
again. Every token is tagged with the policy version the engine sampled it from.
An engine error fails the requests in flight with that error, and a fresh engine takes over.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gspo.rollout.requests import Event, SamplingParams, StepEngine
from gspo.workers import Workers


class Busy(RuntimeError):
    """More samples are waiting than serve.max_waiting allows."""


class EngineFailure(RuntimeError):
    """The engine raised while sampling; the requests in flight get this error."""


@dataclass(frozen=True)
class Token:
    """One drawn token of sample `index` of a request (token -1 when it was cancelled)."""

    index: int
    token: int
    logprob: float
    top: list[tuple[int, float]] | None
    finish_reason: str | None
    version: int


@dataclass(eq=False)
class Handle:
    """A request as an asyncio handler sees it: its tokens arrive on `queue` as lists (one per step, or
    with `at_end` one when all its samples have ended), or an exception when the engine failed or the
    server stops."""

    prompt_ids: list[int]
    n: int
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    at_end: bool = False
    """Hold the tokens until the last sample ends: a handler that answers whole, with no stop string to
    watch for, has nothing to do with them sooner (one wake of the event loop per request, not per step)."""
    queue: asyncio.Queue[list[Token] | BaseException] = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    request: Any = None  # the engine's Request, once admitted
    held: list[Token] = field(default_factory=list)  # drawn, not delivered yet (driver thread only)

    def deliver(self, item: list[Token] | BaseException) -> None:
        """From the driver thread: hand `item` to the handler's event loop."""
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class Driver:
    """Runs the calls it is handed and steps `engine_factory()`'s engine in a thread of ``workers`` (the
    run's: gspo.workers) while there is work (module docstring)."""

    def __init__(
        self, engine_factory: Callable[[], StepEngine], workers: Workers, *, max_waiting: int = 0
    ) -> None:
        self.engine_factory = engine_factory
        self.engine = self.engine_factory()
        self.max_waiting = max_waiting
        self.version = 0
        """The policy version the engine's weights are (set between steps, or while paused)."""
        self.steps = 0
        self.tokens = 0
        self.errors = 0
        self.last_error: str | None = None
        self._cond = threading.Condition()
        self._pending: collections.deque[Handle] = collections.deque()  # accepted, not given to the engine
        self._live: dict[int, Handle] = {}  # engine request id -> handle
        self._calls: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            collections.deque()
        )
        self._paused = False
        self._drained = threading.Event()
        self._stopping = False
        self._busy_since: float | None = None  # when the current step began (health: a stuck step shows)
        self.workers = workers
        self._thread = workers.thread("engine", self._run)

    # ---- the event loop's side -------------------------------------------------------------------------
    def submit(
        self, prompts: Sequence[tuple[Sequence[int], SamplingParams]], n: int, *, at_end: bool = False
    ) -> list[Handle]:
        """Queue n samples of each (prompt ids, params) of a request, all or none: Busy when they would
        pass serve.max_waiting samples waiting for a slot. `at_end`: see `Handle`."""
        loop = asyncio.get_running_loop()
        handles = [Handle(list(ids), n, params, loop, at_end) for ids, params in prompts]
        with self._cond:
            if self._stopping:
                raise EngineFailure("the server is shutting down")
            waiting, adds = sum(h.n for h in self._pending), n * len(handles)
            if waiting + adds > self.max_waiting:
                raise Busy(
                    f"{waiting} samples are waiting for a slot and this request adds {adds}, beyond "
                    f"serve.max_waiting={self.max_waiting}"
                )
            self._pending.extend(handles)
            self._cond.notify()
        return handles

    def cancel(self, handle: Handle) -> None:
        """Stop a request: not started, it never starts; running, its slots are freed at the next step."""
        with self._cond:
            handle.cancelled = True
            if handle in self._pending:
                self._pending.remove(handle)
            elif handle.request is not None:
                self.engine.cancel(handle.request)
            self._cond.notify()

    def between_steps(self, call: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `call` in the driver thread before its next step; the future holds its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._calls.append((call, future))
            self._cond.notify()
        return future

    async def pause(self, timeout: float) -> None:
        """Admit nothing new and wait until the engine has finished what it runs (TimeoutError after
        `timeout` seconds, admitting again)."""
        with self._cond:
            self._paused = True
            self._drained.clear()
            self._cond.notify()
        if not await self.workers.in_thread(lambda: self._drained.wait(timeout)):
            self.resume()
            raise TimeoutError(f"the running samples did not finish within {timeout:.0f} s")

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify()

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop the thread once the call or step it runs has ended (waiting at most ``timeout`` seconds; None:
        as long as that takes); calls not begun are cancelled, requests still waiting or running get an
        error."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)
        self._fail_all(EngineFailure("the server is shutting down"))

    def status(self) -> dict[str, Any]:
        with self._cond:
            waiting = sum(h.n for h in self._pending)
            running = sum(h.n for h in self._live.values())
            busy = self._busy_since
        return {
            "alive": self._thread.is_alive(),
            "paused": self._paused,
            "version": self.version,
            "waiting_samples": waiting,
            "running_samples": running,
            "slots": self.engine.slots,
            "steps": self.steps,
            "tokens": self.tokens,
            "step_seconds": round(time.monotonic() - busy, 3) if busy is not None else 0.0,
            "errors": self.errors,
            "last_error": self.last_error,
        }

    # ---- the driver thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._has_work():
                    if self._paused:
                        self._drained.set()
                    self._cond.wait(timeout=1.0)
                if self._stopping:
                    for _, future in self._calls:  # never to run: whoever waits on one hears so
                        future.cancel()
                    self._calls.clear()
                    return
                calls = list(self._calls)
                self._calls.clear()
                admitted = [] if self._paused else list(self._pending)
                if admitted:
                    self._pending.clear()
            for call, future in calls:
                if not future.set_running_or_notify_cancel():  # cancelled while it waited
                    continue
                try:
                    future.set_result(call())
                except BaseException as error:  # the caller sees it
                    future.set_exception(error)
            for handle in admitted:
                self._admit(handle)
            if not self.engine.idle:
                self._step()
            else:
                self.engine.release()  # no work: the cache's memory goes back

    def _has_work(self) -> bool:
        return (
            self._stopping
            or bool(self._calls)
            or (not self._paused and bool(self._pending))
            or not self.engine.idle
        )

    def _admit(self, handle: Handle) -> None:
        try:
            request = self.engine.submit(handle.prompt_ids, handle.n, handle.params)
        except ValueError as error:  # checked by the handlers first: a prompt past the context, ...
            handle.deliver(error)
            return
        with self._cond:
            handle.request = request
            self._live[request.id] = handle
            if handle.cancelled:  # cancelled between leaving the queue and now
                self.engine.cancel(request)

    def _step(self) -> None:
        self._busy_since = time.monotonic()
        try:
            events = self.engine.step()
        except Exception as error:  # a bug or out of memory: fail what runs, start a fresh engine
            self.errors += 1
            self.last_error = f"{type(error).__name__}: {error}"
            traceback.print_exc()
            # what it ran fails; what waits to be admitted goes to the fresh engine
            self._fail_all(EngineFailure(f"the sampling engine failed: {self.last_error}"), waiting=False)
            self.engine = self.engine_factory()
            return
        finally:
            self._busy_since = None
        self.steps += 1
        self.tokens += sum(e.token >= 0 for e in events)
        self._deliver(events)

    def _deliver(self, events: list[Event]) -> None:
        by_request: dict[int, list[Token]] = collections.defaultdict(list)
        for e in events:
            by_request[e.sample.request.id].append(
                Token(e.sample.index, e.token, e.logprob, e.top_logprobs, e.finish_reason, self.version)
            )
        ready = []
        with self._cond:
            for rid, tokens in by_request.items():
                handle = self._live.get(rid)
                if handle is not None:
                    ended = handle.request.done
                    if ended:
                        del self._live[rid]
                    ready.append((handle, tokens, ended))
        for handle, tokens, ended in ready:
            handle.held += tokens
            if ended or not handle.at_end:
                handle.deliver(handle.held)
                handle.held = []

    def _fail_all(self, error: BaseException, *, waiting: bool = True) -> None:
        with self._cond:
            handles = [*(self._pending if waiting else []), *self._live.values()]
            if waiting:
                self._pending.clear()
            self._live.clear()
        for handle in handles:
            handle.deliver(error)
