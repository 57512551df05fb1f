"""How gspo calls reward functions, and scores a batch with several of them (docs/rewards.md).

A reward function is declared by its signature:

- **the whole batch per call**: ``f(prompts, completions, **fields) -> list[float]`` (each field a list
  aligned with ``completions``), called with keywords when it names a ``completions`` parameter or takes
  keywords only (TRL's ``def reward_len(completions, **kwargs)``), else positionally (``lambda p, c, **_``);
- **one completion per call**: ``f(completion, **fields) -> float``, its first parameter named
  ``completion`` (``prompt=`` and each field arrive as single values; only the keywords it accepts, unless it
  takes ``**kwargs``);
- either may be ``async def``: its calls then run concurrently on the run's event loop (`reward_loop`),
  at most ``reward_concurrency`` at a time; a plain function may opt into the same concurrency in threads
  with ``@gspo.reward(threads=True)`` (a function that waits on I/O without asyncio).

Every call has a deadline (``reward_timeout`` seconds per call); an error, a timeout, or a value that is not
a finite number stops the run with one line naming the function and the sample (`RewardError`, exit code 7).
A batch's plain functions run in the caller's thread, in order, while its concurrent ones run on the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import math
import numbers
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from gspo.rollout.user_code import raised, raised_where

RewardFunction = Callable[..., Any]
"""A reward function, as the user writes it (module docstring)."""

T = TypeVar("T")
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


class RewardError(RuntimeError):
    """A reward function failed or returned something unusable; the message names it and the sample."""


def reward(function: RewardFunction | None = None, *, threads: bool = False) -> Any:
    """Declare how gspo calls a plain reward function: ``threads=True`` runs its calls in threads,
    concurrently (at most ``reward_concurrency``), as an ``async def`` one's run on the event loop.

    >>> @reward(threads=True)
    ... def judged(completion, **_):
    ...     return 1.0
    """

    def mark(f: RewardFunction) -> RewardFunction:
        f.gspo_threads = threads  # type: ignore[attr-defined]
        return f

    return mark(function) if function is not None else mark


# ---- the run's event loop -----------------------------------------------------------------------------
_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def reward_loop() -> asyncio.AbstractEventLoop:
    """The event loop every concurrent reward call of this process (a run) awaits on, in a daemon thread of
    its own, started on first use: one loop, whichever thread scores a batch."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="gspo-rewards", daemon=True).start()
            _LOOP = loop
        return _LOOP


# ---- one function, as gspo calls it -------------------------------------------------------------------
@dataclass(frozen=True)
class Prepared:
    """A reward function as gspo calls it (module docstring): by batch or per completion, concurrently or
    not, with its deadline. Calling it scores a batch, `f(prompts, completions, **fields)`, as a plain batch
    function would be called."""

    function: RewardFunction
    name: str
    per_completion: bool
    is_async: bool
    threads: bool
    keywords: bool
    """Batch functions: called with keywords (else positionally)."""
    accepts: frozenset[str] | None
    """Per-completion functions: the keywords they take (None: any, ``**kwargs``)."""
    timeout: float
    """Seconds a call may take; 0: no limit."""
    concurrency: int
    """Calls in flight at once (concurrent functions)."""

    @property
    def concurrent(self) -> bool:
        return self.is_async or self.threads

    @property
    def __wrapped__(self) -> RewardFunction:  # inspect.signature and validate_example read the function's
        return self.function

    def __getattr__(self, name: str) -> Any:  # the function's own attributes (validate_example, ...)
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.function, name)

    def __call__(self, prompts: list[Any], completions: list[Any], **fields: Any) -> list[Any]:
        return score_batch([self], prompts, completions, fields)[self.name]

    # -- the calls of one batch --
    def _kwargs(self, prompts: list[Any], completions: list[Any], fields: dict[str, list], i: int) -> dict:
        values = {"completion": completions[i], "prompt": prompts[i], **{k: v[i] for k, v in fields.items()}}
        return values if self.accepts is None else {k: v for k, v in values.items() if k in self.accepts}

    def _batch_call(self, prompts: list[Any], completions: list[Any], fields: dict[str, list]) -> Any:
        if self.keywords:
            return self.function(prompts=prompts, completions=completions, **fields)
        return self.function(prompts, completions, **fields)


DEFAULT_CONCURRENCY = 32
"""Calls of a concurrent reward function in flight at once, unless ``reward_concurrency`` says otherwise."""


def prepare(
    function: RewardFunction, name: str, *, timeout: float | None = None, concurrency: int | None = None
) -> Prepared:
    """How ``function`` is called (module docstring), read once from its signature: named ``name``, each call
    within ``timeout`` seconds (None: none; a `Prepared` keeps its own), at most ``concurrency`` in flight.

    >>> def reward_len(completions, **kwargs):
    ...     return [-abs(3 - len(c)) for c in completions]
    >>> prepare(reward_len, "reward_len")(["p"], ["abcd"])
    [-1.0]
    """
    if isinstance(function, Prepared):
        changes = {"timeout": timeout, "concurrency": concurrency}
        return dataclasses.replace(function, name=name, **{k: v for k, v in changes.items() if v is not None})
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # some builtins and C callables have no signature to read
        parameters = []
    named = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    positional = [
        p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    per_completion = bool(parameters) and parameters[0].name == "completion"
    any_keyword = any(p.kind is p.VAR_KEYWORD for p in parameters)
    target = function.__call__ if not inspect.isroutine(function) and callable(function) else function
    return Prepared(
        function,
        name,
        per_completion=per_completion,
        is_async=inspect.iscoroutinefunction(target),
        threads=bool(getattr(function, "gspo_threads", False)),
        keywords=bool(parameters) and ("completions" in named or not positional),
        accepts=None if any_keyword else frozenset(named),
        timeout=timeout or 0.0,
        concurrency=concurrency or DEFAULT_CONCURRENCY,
    )


# ---- a batch, all functions -----------------------------------------------------------------------------
def score_batch(
    rewards: Sequence[Prepared], prompts: list[Any], completions: list[Any], fields: dict[str, list]
) -> dict[str, list[float]]:
    """Each reward's values on the batch, checked (module docstring): the concurrent functions' calls start
    on the loop, the plain ones run here meanwhile, in order; the first error, in the rewards' order, is
    raised."""
    concurrent = [r for r in rewards if r.concurrent]
    pending = asyncio.run_coroutine_threadsafe(
        _gather(concurrent, prompts, completions, fields), reward_loop()
    ) if concurrent else None  # fmt: skip
    outcomes: dict[str, list[Any] | BaseException] = {}
    for r in rewards:
        if not r.concurrent:
            try:
                outcomes[r.name] = _plain(r, prompts, completions, fields)
            except (RewardError, KeyboardInterrupt) as error:
                outcomes[r.name] = error
    if pending is not None:
        outcomes |= pending.result()
    values = {}
    for r in rewards:
        outcome = outcomes[r.name]
        if isinstance(outcome, BaseException):
            raise outcome
        values[r.name] = check_values(r.name, outcome, completions)
    return values


def _plain(r: Prepared, prompts: list[Any], completions: list[Any], fields: dict[str, list]) -> list[Any]:
    """A plain function's values, its calls one after another in this thread, each with its deadline."""
    if r.per_completion:
        return [
            _guarded(
                r,
                i,
                completions,
                lambda i=i: _deadline(r, lambda: r.function(**r._kwargs(prompts, completions, fields, i))),
            )
            for i in range(len(completions))
        ]
    try:
        return _deadline(r, lambda: r._batch_call(prompts, completions, fields))
    except RewardError:  # a timeout: calling it again per sample would only hang again
        raise
    except (Exception, SystemExit) as error:  # sys.exit in a reward is its failure, not gspo's exit
        raise _culprit(r, prompts, completions, fields, error) from error


def _guarded(r: Prepared, i: int, completions: list[Any], call: Callable[[], T]) -> T:
    try:
        return call()
    except RewardError:
        raise
    except (Exception, SystemExit) as error:
        raise _at_sample(r, i, completions, error) from error


def _at_sample(r: Prepared, i: int, completions: list[Any], error: BaseException) -> RewardError:
    return RewardError(
        f"reward function {r.name!r} {raised(error)} at sample {i} (completion {_excerpt(completions[i])})"
        f"{raised_where(error, r.function)}"
    )


def _culprit(
    r: Prepared, prompts: list[Any], completions: list[Any], fields: dict[str, list], error: BaseException
) -> RewardError:
    """A batch call's error, named with its sample: found by calling again one sample at a time (an async
    function to its end on a loop of its own: this runs in a thread of its own then)."""
    for i in range(len(completions)):
        single = {key: values[i : i + 1] for key, values in fields.items()}
        try:
            called = r._batch_call(prompts[i : i + 1], completions[i : i + 1], single)
            if inspect.isawaitable(called):
                asyncio.run(_awaited(called))
        except (Exception, SystemExit) as alone:
            return _at_sample(r, i, completions, alone)
    return RewardError(
        f"reward function {r.name!r} {raised(error)} on the batch of {len(completions)} samples, though no "
        f"single sample raises alone{raised_where(error, r.function)}"
    )


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _too_slow(r: Prepared) -> RewardError:
    return RewardError(
        f"reward function {r.name!r} did not return within {r.timeout:g} s (reward_timeout): it may hang (a "
        "network call, a subprocess, an endless loop); fix it, or raise reward_timeout if it needs longer"
    )


def _deadline(r: Prepared, call: Callable[[], T]) -> T:
    """``call()`` with ``r``'s deadline: a call still running then raises RewardError. Python cannot stop a
    running function from outside, so the call runs in a daemon thread that is abandoned at the deadline:
    it ends with the process (the run stops with the error, after a checkpoint)."""
    if not r.timeout:
        return call()
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = call()
        except BaseException as error:  # handed to the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=target, name=f"gspo-reward-{r.name}", daemon=True)
    thread.start()
    thread.join(r.timeout)
    if thread.is_alive():
        raise _too_slow(r)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


async def _gather(
    rewards: list[Prepared], prompts: list[Any], completions: list[Any], fields: dict[str, list]
) -> dict[str, list[Any] | BaseException]:
    """The concurrent functions' values (or errors), every call on the loop at once, at most each one's
    concurrency of its calls in flight."""
    results = await asyncio.gather(
        *(_concurrent(r, prompts, completions, fields) for r in rewards), return_exceptions=True
    )
    return {r.name: result for r, result in zip(rewards, results, strict=True)}


_POOLS: dict[int, concurrent.futures.ThreadPoolExecutor] = {}


def _pool(size: int) -> concurrent.futures.ThreadPoolExecutor:
    """The threads of ``@reward(threads=True)`` functions: one pool per concurrency bound, kept."""
    if size not in _POOLS:
        _POOLS[size] = concurrent.futures.ThreadPoolExecutor(size, thread_name_prefix="gspo-reward")
    return _POOLS[size]


async def _concurrent(
    r: Prepared, prompts: list[Any], completions: list[Any], fields: dict[str, list]
) -> list[Any]:
    limit = asyncio.Semaphore(r.concurrency)

    async def run(call: Callable[[], Any]) -> Any:
        async with limit:
            waited = (
                call()
                if r.is_async
                else asyncio.get_running_loop().run_in_executor(_pool(r.concurrency), call)
            )
            try:
                return await asyncio.wait_for(waited, r.timeout or None)
            except TimeoutError:
                raise _too_slow(r) from None

    if r.per_completion:

        async def one(i: int) -> Any:
            try:
                return await run(lambda: r.function(**r._kwargs(prompts, completions, fields, i)))
            except RewardError:
                raise
            except (Exception, SystemExit) as error:
                raise _at_sample(r, i, completions, error) from error

        return list(await asyncio.gather(*(one(i) for i in range(len(completions)))))
    try:
        return await run(lambda: r._batch_call(prompts, completions, fields))
    except RewardError:
        raise
    except (Exception, SystemExit) as error:
        raise await asyncio.to_thread(_culprit, r, prompts, completions, fields, error) from error


# ---- the checked values, combined -----------------------------------------------------------------------
def _excerpt(completion: Any) -> str:
    text = str(completion)
    return repr(text[:80]) + ("..." if len(text) > 80 else "")


def check_values(name: str, values: Any, completions: list[Any]) -> list[float]:
    """A function's values as floats: one finite number per completion (a list, a tuple, a tensor or a numpy
    array; not a boolean), within float32's range."""
    if hasattr(values, "tolist"):  # tensors and numpy arrays
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise RewardError(
            f"reward function {name!r} returned {type(values).__name__}, expected a list of "
            f"{len(completions)} floats (one per completion)"
        )
    if len(values) != len(completions):
        raise RewardError(
            f"reward function {name!r} returned {len(values)} values for {len(completions)} completions"
        )
    for index, value in enumerate(values):
        if isinstance(value, bool):  # a bool is an int to Python, but "passed?" is no amount of reward
            raise RewardError(
                f"reward function {name!r} returned {value!r} at sample {index} "
                f"(completion {_excerpt(completions[index])}); rewards are numbers, not booleans: return "
                "1.0 or 0.0 (float(passed))"
            )
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardError(
                f"reward function {name!r} returned {value!r} at sample {index} "
                f"(completion {_excerpt(completions[index])}); rewards must be finite numbers"
            )
        if abs(value) > _FLOAT32_MAX:
            raise RewardError(
                f"reward function {name!r} returned {value!r} at sample {index} "
                f"(completion {_excerpt(completions[index])}), beyond float32's range (about 3.4e38), "
                "in which rewards are combined; return smaller values"
            )
    return [float(value) for value in values]


def compute_rewards(
    functions: Sequence[tuple[str, RewardFunction, float]],
    prompts: list[str],
    completions: list[str],
    fields: dict[str, list],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Score the batch with each reward function and combine: ``(total, {name: rewards})``.

    ``functions`` holds ``(name, function, weight)`` (a plain function is called as a batch function with
    no deadline; `prepare` says how to call it otherwise); every list (prompts, each field) is aligned with
    ``completions``, B long. Returns float32 tensors:

        total = sum_k weight_k * r_k    (B,)
        r_k                             (B,)

    A function that raises, returns a non-finite or non-numeric value, or the wrong number of values gives a
    :class:`RewardError` naming it (and the sample, where there is one).
    """
    if not functions:
        raise ValueError("compute_rewards needs at least one reward function")
    names = [name for name, _, _ in functions]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"reward names must be unique, repeated: {duplicates}")
    for name, _, weight in functions:
        if not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise ValueError(f"reward {name!r} has weight {weight!r}; weights must be finite numbers")
    for key, values in {"prompts": prompts, **fields}.items():
        if len(values) != len(completions):
            raise ValueError(f"{key!r} has {len(values)} entries for {len(completions)} completions")
    prepared = [prepare(function, name) for name, function, _ in functions]
    values = score_batch(prepared, prompts, completions, fields)
    total = torch.zeros(len(completions), dtype=torch.float32)
    per_function = {}
    for name, _, weight in functions:
        rewards = torch.tensor(values[name], dtype=torch.float32)
        per_function[name] = rewards
        total += float(weight) * rewards
    if not torch.isfinite(total).all():
        raise RewardError(
            f"the weighted sum of the rewards {names} overflows float32 at sample "
            f"{int((~torch.isfinite(total)).nonzero()[0])}: lower the weights or the rewards"
        )
    return total, per_function
