"""Every thread, pool and event loop of a run, owned by one object: `Workers`.

A run (`gspo train`, `gspo serve`, a `Trainer` in Python) makes one `Workers`; whatever runs beside the
trainer's own thread borrows from it and never starts a thread, pool or loop of its own:

- `stage(name)`: a thread that runs the calls it is handed in order, each a future (`Stage`): the sampling
  side's thread, the scoring stage, the checkpoint writer. ``on_start`` runs first in its thread (the
  sampling side makes its torch ops single-threaded there: gspo.run.cpu).
- `pool(size)`: daemon threads for calls that may run side by side (``@gspo.reward(threads=True)``
  functions, a server's requests); one pool per size, reused.
- `loop()`: the run's event loop, in a thread of its own (async rewards, the LLM judge); `loop_answers`
  tells a busy loop from a blocked one.
- `later(seconds, fn)`: one timer thread for every deadline (a request's watchdog); `Timer.cancel`.
- `thread(name, target)`: a thread for one long call (uvicorn's server loop).
- `close()`: stops them all: what waits is cancelled, what runs ends first (for at most ``timeout``
  seconds; a thread stuck in user code is left behind, a daemon that ends with the process). Whatever is
  asked of the workers after it starts afresh (a finished run's `Trainer.evaluate`).

`wait(future, timeout, what)` waits for a future with a deadline. A call that outlives its deadline leaves
its thread stuck in user code (Python cannot stop a running function): `Stage.replace` and `abandon_loop`
give the work after it a fresh thread or loop, and the stuck one is left behind. Every thread is a daemon
and no pool is a concurrent.futures executor, whose threads the interpreter joins at exit: a reward that
hangs cannot keep a stopped run's process alive.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


SERVE_POOL = 4
"""Threads of the pool that `Workers.in_thread` runs short waits in (a server pausing its engine)."""


class Stage:
    """``threads`` daemon threads named ``name`` that run the calls handed to `submit` in their order (one
    thread: one after another), each call's result or exception in its future."""

    def __init__(self, name: str, threads: int = 1, on_start: Callable[[], Any] | None = None) -> None:
        self.name, self.size, self.on_start = name, threads, on_start
        self._calls: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            collections.deque()
        )
        self._cond = threading.Condition()
        self._closing = False
        self._generation = 0
        self._threads: list[threading.Thread] = []
        self._start(self.size)

    def _start(self, count: int) -> None:
        for _ in range(count):
            thread = threading.Thread(
                target=self._run, args=(self._generation,), name=f"gspo-{self.name}", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` in the stage's turn; its future holds the result or the exception (a BaseException too:
        a KeyboardInterrupt or SystemExit raised inside it is the caller's to raise)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._cond:
            if self._closing:
                raise RuntimeError(f"the {self.name} stage is closed")
            self._calls.append((fn, future))
            self._cond.notify()
        return future

    def _run(self, generation: int) -> None:
        if self.on_start is not None:
            self.on_start()
        while True:
            with self._cond:
                while not self._calls and not self._closing and generation == self._generation:
                    self._cond.wait()
                if generation != self._generation or (self._closing and not self._calls):
                    return
                fn, future = self._calls.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as error:  # handed to whoever waits for it
                future.set_exception(error)
            if generation != self._generation:  # replaced while this call ran: the new threads go on
                return

    def replace(self) -> None:
        """Leave the stage's threads behind (one is stuck in a call that outlived its deadline) and start
        fresh ones for the calls still waiting and those to come."""
        with self._cond:
            self._generation += 1
            self._threads = []
            self._cond.notify_all()
            self._start(self.size)

    def close(self, timeout: float | None = None) -> None:
        """Cancel the calls not begun; let the running ones end (for at most ``timeout`` seconds)."""
        with self._cond:
            self._closing = True
            waiting, self._calls = list(self._calls), collections.deque()
            self._cond.notify_all()
        for _, future in waiting:
            future.cancel()
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))


class InPlace:
    """A stage without a thread of its own: `submit`'s call runs when its result is first asked for, in the
    asking thread (`Deferred`): stages in place run one after another, as the asker needs them (rollout.lag
    0: the very same steps as threaded stages, in the trainer's thread)."""

    name = "in place"

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        return Deferred(fn)

    def replace(self) -> None:
        pass

    def close(self, timeout: float | None = None) -> None:
        pass


class Deferred(concurrent.futures.Future):
    """A future whose call runs in the first thread that asks for its result (`InPlace`)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__()
        self._fn: Callable[[], Any] | None = fn

    def _run(self) -> None:
        fn, self._fn = self._fn, None
        if fn is None or not self.set_running_or_notify_cancel():
            return
        try:
            self.set_result(fn())
        except BaseException as error:  # the asker's to raise
            self.set_exception(error)

    def result(self, timeout: float | None = None) -> Any:
        self._run()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._run()
        return super().exception(timeout)


class Timer:
    """A call `Workers.later` makes at its time, unless cancelled first."""

    def __init__(self, when: float, fn: Callable[[], Any]) -> None:
        self.when, self.fn, self.cancelled = when, fn, False

    def cancel(self) -> None:
        self.cancelled = True


class Workers:
    """A run's threads, pools and event loop (module docstring), each started on first use."""

    def __init__(self, name: str = "run") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._stages: dict[str, Stage] = {}
        self._pools: dict[int, Stage] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._timers: list[tuple[float, int, Timer]] = []
        self._timer_cond = threading.Condition()
        self._timer_thread: threading.Thread | None = None
        self._count = itertools.count()
        self._threads: list[threading.Thread] = []

    # ---- stages and pools --------------------------------------------------------------------------------
    def stage(self, name: str, *, on_start: Callable[[], Any] | None = None) -> Stage:
        """The run's stage ``name``: a thread of its own that runs calls one after another (`Stage`), made on
        first use (``on_start`` runs first in its thread) and closed with the run."""
        with self._lock:
            if name not in self._stages:
                self._stages[name] = Stage(name, 1, on_start)
            return self._stages[name]

    def pool(self, size: int) -> Stage:
        """``size`` threads that run calls side by side: one pool per size, made on first use and reused."""
        with self._lock:
            if size not in self._pools:
                self._pools[size] = Stage(f"pool-{size}", size)
            return self._pools[size]

    async def in_thread(self, fn: Callable[[], T], stage: str | None = None) -> T:
        """``fn()`` awaited from an event loop (a server's), run in the stage of that name (one after another),
        or in the run's pool of `SERVE_POOL` threads (side by side)."""
        runner = self.stage(stage) if stage is not None else self.pool(SERVE_POOL)
        return await asyncio.wrap_future(runner.submit(fn))

    # ---- the event loop ----------------------------------------------------------------------------------
    def loop(self) -> asyncio.AbstractEventLoop:
        """The run's event loop, running in a thread of its own from the first call on."""
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=_serve_forever, args=(loop,), name="gspo-loop", daemon=True)
                thread.start()
                self._loop, self._loop_thread = loop, thread
            return self._loop

    def run(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """``coroutine`` on the run's loop; its future holds the result, or any exception, a BaseException
        included (which never reaches the loop itself: a SystemExit there would stop it)."""
        return asyncio.run_coroutine_threadsafe(_contained(coroutine), self.loop())

    def loop_answers(self, within: float) -> bool:
        """Whether the run's loop runs a callback within ``within`` seconds: busy (a loaded machine) rather
        than blocked (a coroutine that never yields). False when no loop has started."""
        with self._lock:
            loop = self._loop
        if loop is None:
            return False
        ran = threading.Event()
        loop.call_soon_threadsafe(ran.set)
        return ran.wait(within)

    def abandon_loop(self) -> None:
        """Leave the loop behind (a coroutine blocks it past its deadline); the next `loop` is a fresh one."""
        with self._lock:
            loop, self._loop, self._loop_thread = self._loop, None, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)

    # ---- timers and single threads -----------------------------------------------------------------------
    def later(self, seconds: float, fn: Callable[[], Any]) -> Timer:
        """Call ``fn`` (quick: it runs in the one timer thread) in ``seconds``, unless the Timer is cancelled."""
        timer = Timer(time.monotonic() + seconds, fn)
        with self._timer_cond:
            heapq.heappush(self._timers, (timer.when, next(self._count), timer))
            if self._timer_thread is None:
                self._timer_thread = threading.Thread(target=self._fire, name="gspo-timers", daemon=True)
                self._timer_thread.start()
            self._timer_cond.notify()
        return timer

    def _fire(self) -> None:
        me = threading.current_thread()
        while True:
            with self._timer_cond:
                while self._timer_thread is me and (
                    not self._timers or self._timers[0][0] > time.monotonic()
                ):
                    wait = self._timers[0][0] - time.monotonic() if self._timers else None
                    self._timer_cond.wait(wait)
                if self._timer_thread is not me:  # closed
                    return
                _, _, timer = heapq.heappop(self._timers)
            if not timer.cancelled:
                with contextlib.suppress(Exception):  # a watchdog's failure must not stop the others
                    timer.fn()

    def thread(self, name: str, target: Callable[..., Any], **kwargs: Any) -> threading.Thread:
        """A daemon thread running ``target(**kwargs)`` (one long call: a server's loop), started."""
        thread = threading.Thread(target=target, kwargs=kwargs, name=f"gspo-{name}", daemon=True)
        with self._lock:
            self._threads.append(thread)
        thread.start()
        return thread

    # ---- the end -------------------------------------------------------------------------------------------
    def close(self, timeout: float | None = 10.0) -> None:
        """Stop everything (module docstring); calls not begun are cancelled."""
        with self._lock:
            stages = [*self._stages.values(), *self._pools.values()]
            self._stages, self._pools = {}, {}
        with self._timer_cond:
            self._timers = []
            self._timer_cond.notify_all()
            self._timer_thread = None
        for stage in stages:
            stage.close(timeout)
        self.abandon_loop()


def wait(future: concurrent.futures.Future[T], timeout: float | None) -> T:
    """``future``'s result within ``timeout`` seconds (None or 0: no limit): TimeoutError after it; the
    future's own exception, whatever it is (a KeyboardInterrupt raised in a stage reaches its waiter)."""
    return future.result(timeout or None)


def _serve_forever(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        loop.close()


async def _contained(coroutine: Coroutine[Any, Any, T]) -> T:
    """``coroutine``'s result, with a BaseException it raises (SystemExit, KeyboardInterrupt) turned into one
    the loop hands to the future instead of stopping on it."""
    try:
        return await coroutine
    except (KeyboardInterrupt, SystemExit, GeneratorExit) as error:
        raise Escaped(error) from error


class Escaped(Exception):
    """A KeyboardInterrupt, SystemExit or GeneratorExit raised inside a coroutine on the run's loop, carried
    to its waiter (`original`) as an ordinary exception."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(f"{type(original).__name__}: {original}")
        self.original = original
