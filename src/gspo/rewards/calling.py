"""How gspo calls reward functions, and scores a batch with several of them (docs/rewards.md).

A reward function is declared by its signature:

- **the whole batch per call**: ``f(prompts, completions, **fields) -> list[float]`` (each field a list
  aligned with ``completions``), called with keywords when it names a ``completions`` parameter or takes
  keywords only (TRL's ``def reward_len(completions, **kwargs)``), else positionally (``lambda p, c, **_``);
- **one completion per call**: ``f(completion, **fields) -> float``, its first parameter named
  ``completion`` (``prompt=`` and each field arrive as single values; only the keywords it accepts, unless it
  takes ``**kwargs``);
- either may be ``async def``: its calls then run concurrently on the run's event loop (gspo.workers), at
  most ``reward_concurrency`` at a time; a plain function may opt into the same concurrency in the run's
  threads with ``@gspo.reward(threads=True)`` (a function that waits on I/O without asyncio).

Every call has a deadline (``reward_timeout`` seconds per call); an error, a timeout, or a value that is not
a finite number stops the run with one line naming the function and the sample (`RewardError`, exit code 7),
whatever the function raised or returned (a BaseException of its own, an int too large for a float); a
KeyboardInterrupt inside one stops the run as Ctrl-C does. A batch's plain functions run one call after
another in the run's reward-calls thread (with a deadline: the caller waits for each at most its timeout,
and a call that outlives it is left behind in its thread), while its concurrent ones run on the loop; an
``async def`` that blocks the loop (a time.sleep inside) is cut off the same way. No thread is started per
call: every thread and the loop are the run's (gspo.workers.Workers).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import inspect
import math
import numbers
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from gspo.rollout.user_code import raised, raised_where
from gspo.workers import Escaped, Workers

RewardFunction = Callable[..., Any]
"""A reward function, as the user writes it (module docstring)."""

T = TypeVar("T")
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_FLOAT32_EPS = float(torch.finfo(torch.float32).eps)


class RewardError(RuntimeError):
    """A reward function failed or returned something unusable; the message names it and the sample."""


def reward(
    function: RewardFunction | None = None, *, threads: bool = False, best: float | None = None
) -> Any:
    """Declare how gspo calls a plain reward function: ``threads=True`` runs its calls in threads,
    concurrently (at most ``reward_concurrency``), as an ``async def`` one's run on the event loop.
    ``best``: the value of a completion that is all right, the most the function gives. A group whose
    completions all score the rewards' best has learned its prompt: a run whose groups all reach it is
    saturated, not collapsed, and with rollout.keep_solved_groups dynamic sampling draws no other prompt in
    its place
    (gspo.rewards.scoring.Rewards.best).

    >>> @reward(threads=True, best=1.0)
    ... def judged(completion, **_):
    ...     return 1.0
    >>> judged.gspo_best
    1.0
    """

    def mark(f: RewardFunction) -> RewardFunction:
        f.gspo_threads = threads  # type: ignore[attr-defined]
        if best is not None:
            if isinstance(best, bool) or not isinstance(best, numbers.Real) or not math.isfinite(best):
                raise TypeError(f"reward(best={best!r}): best is a finite number, e.g. best=1.0")
            f.gspo_best = float(best)  # type: ignore[attr-defined]
        return f

    return mark(function) if function is not None else mark


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
        with borrowed(None) as workers:
            return score_batch([self], prompts, completions, fields, workers)[self.name]

    def takes(self, keyword: str) -> bool:
        """Whether it takes ``keyword`` (by name, or in ``**kwargs``)."""
        return self.accepts is None or keyword in self.accepts

    def own_fields(self, fields: dict[str, list], keywords: Keywords | None) -> dict[str, list]:
        """``fields`` with the run's per-sample keywords it takes (`Keywords.per_sample`: a batch function
        gets the lists, one per completion its own value, under the singular name where there is one)."""
        if keywords is None:
            return fields
        own = dict(fields)
        for key, values in keywords.per_sample.items():
            name = SINGULAR.get(key, key) if self.per_completion else key
            if self.takes(name):
                own[name] = values
        return own

    def own_shared(self, keywords: Keywords | None) -> dict[str, Any]:
        """The run's shared keywords it takes (`Keywords.shared`)."""
        if keywords is None:
            return {}
        return {key: value for key, value in keywords.shared.items() if self.takes(key)}

    def calls(
        self, prompts: list[Any], completions: list[Any], fields: dict[str, list], keywords: Keywords | None
    ) -> Calls:
        """Its calls on this batch, with the fields and keywords it takes."""
        return Calls(self, prompts, completions, self.own_fields(fields, keywords), self.own_shared(keywords))


@dataclass(frozen=True)
class Calls:
    """One function's calls on one batch: the whole batch at once (`batch`), or one completion (`one`)."""

    r: Prepared
    prompts: list[Any]
    completions: list[Any]
    fields: dict[str, list]
    shared: dict[str, Any]

    def one(self, i: int) -> Any:
        r = self.r
        values = {"completion": self.completions[i], "prompt": self.prompts[i]}
        values |= {k: v[i] for k, v in self.fields.items()} | self.shared
        return r.function(
            **(values if r.accepts is None else {k: values[k] for k in values if k in r.accepts})
        )

    def batch(self) -> Any:
        r = self.r
        if r.keywords:
            return r.function(
                prompts=self.prompts, completions=self.completions, **self.fields, **self.shared
            )
        return r.function(self.prompts, self.completions, **self.fields, **self.shared)

    def alone(self, i: int) -> Calls:
        """The batch of sample ``i`` alone."""
        own = {key: values[i : i + 1] for key, values in self.fields.items()}
        return Calls(self.r, self.prompts[i : i + 1], self.completions[i : i + 1], own, self.shared)


SINGULAR = {"group_ids": "group_id", "example_prompts": "example_prompt"}
KEYWORDS = frozenset({"group_ids", "completion_ids", "example_prompts", "trainer_state", "log_metric"})
"""Every name `Keywords` passes: none of them is an example's field."""
"""A per-sample keyword's name for a function called per completion (it gets its own value)."""


@dataclass(frozen=True)
class Keywords:
    """What gspo passes a reward function beside prompts, completions and the examples' fields, where it
    takes them (by name or in ``**kwargs``), as TRL passes its keywords: per sample, ``group_ids`` (each
    completion's group in the batch), ``completion_ids`` (its token ids) and ``example_prompts`` (its
    example's own prompt, before the chat template); shared by the batch,
    ``trainer_state`` (``global_step``: the rollout batch's step) and ``log_metric(name, value)``, which
    logs a value with the step's metrics (its mean over the batch's calls)."""

    per_sample: dict[str, list[Any]] = dataclasses.field(default_factory=dict)
    shared: dict[str, Any] = dataclasses.field(default_factory=dict)


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
@contextlib.contextmanager
def borrowed(workers: Workers | None) -> Iterator[Workers]:
    """``workers`` (a run's), or, outside a run (a reward function called on its own), ones of the call's
    own, closed after it."""
    if workers is not None:
        yield workers
        return
    own = Workers("reward call")
    try:
        yield own
    finally:
        own.close(timeout=0)


def score_batch(
    rewards: Sequence[Prepared],
    prompts: list[Any],
    completions: list[Any],
    fields: dict[str, list],
    workers: Workers,
    *,
    keywords: Keywords | None = None,
) -> dict[str, list[float | None]]:
    """Each reward's values on the batch, checked (module docstring): the concurrent functions' calls start
    on the run's loop, the plain ones run meanwhile, in order; the first error, in the rewards' order, is
    raised (a KeyboardInterrupt raised inside one as a KeyboardInterrupt). ``keywords``: the run's, for the
    functions that take them (`Keywords`). A value is None where a function scores no such sample (TRL's
    multi-task rewards)."""
    concurrent = [r for r in rewards if r.concurrent]
    pending = (
        workers.run(_gather(concurrent, prompts, completions, fields, keywords, workers))
        if concurrent
        else None
    )
    outcomes: dict[str, list[Any] | BaseException] = {}
    for r in rewards:
        if not r.concurrent:
            try:
                outcomes[r.name] = _plain(r.calls(prompts, completions, fields, keywords), workers)
            except (RewardError, KeyboardInterrupt) as error:
                outcomes[r.name] = error
    if pending is not None:
        outcomes |= _on_the_loop(pending, concurrent, len(completions), workers)
    values = {}
    for r in rewards:
        outcome = outcomes[r.name]
        if isinstance(outcome, BaseException):
            raise outcome
        values[r.name] = check_values(r.name, outcome, completions)
    return values


BUSY_ROUNDS = 4
"""How many more times a batch's deadline is waited for when the loop is busy rather than blocked."""


def _on_the_loop(
    pending: concurrent.futures.Future, rewards: list[Prepared], calls: int, workers: Workers
) -> dict[str, list[Any] | BaseException]:
    """The concurrent functions' outcomes. Each call has its deadline on the loop; a call that blocks the
    loop itself (a blocking call inside an ``async def``) stops every deadline there, so the whole batch
    has one here too: its calls' deadlines in turn, as the concurrency bound lets them run. Past it, a loop
    that still runs callbacks is only slow (a loaded machine: its calls' own deadlines end them, as
    `reward_timeout` errors), and is waited for, up to `BUSY_ROUNDS` more times; one that does not is
    blocked."""
    bounds = [r.timeout * -(-(calls if r.per_completion else 1) // r.concurrency) for r in rewards]
    limit = None if not all(bounds) else max(bounds) + 1.0
    for _ in range(1 + BUSY_ROUNDS):
        try:
            return pending.result(limit)
        except concurrent.futures.TimeoutError:
            if pending.done():
                raise
        if not workers.loop_answers(within=1.0):
            break
    workers.abandon_loop()  # stuck: the rest of the run (its error's checkpoint) gets a fresh loop
    names = ", ".join(repr(r.name) for r in rewards if r.is_async) or ", ".join(repr(r.name) for r in rewards)
    raise RewardError(
        f"reward function {names} did not return within {limit:g} s and blocked the run's event loop: an async "
        "def reward must not make blocking calls (time.sleep, requests, a subprocess's wait): await "
        "asyncio.sleep or an async client instead, or make it a plain def (gspo calls those in a thread "
        "of their own, one call at a time)"
    )


def _plain(calls: Calls, workers: Workers) -> list[Any]:
    """A plain function's values, its calls one after another, each with its deadline (`_within`)."""
    r, completions = calls.r, calls.completions
    if r.per_completion:
        return [
            _guarded(r, i, completions, lambda i=i: _within(r, workers, lambda: calls.one(i)))
            for i in range(len(completions))
        ]
    try:
        return _within(r, workers, calls.batch)
    except (RewardError, KeyboardInterrupt):  # a timeout: calling it again per sample would only hang again
        raise
    except BaseException as error:  # a reward's own exception, sys.exit and GeneratorExit included
        raise _culprit(calls, error, workers) from error


def _guarded(r: Prepared, i: int, completions: list[Any], call: Callable[[], T]) -> T:
    try:
        return call()
    except (RewardError, KeyboardInterrupt):
        raise
    except BaseException as error:
        raise _at_sample(r, i, completions, error) from error


def _at_sample(r: Prepared, i: int, completions: list[Any], error: BaseException) -> RewardError:
    return RewardError(
        f"reward function {r.name!r} {raised(error)} at sample {i} (completion {_excerpt(completions[i])})"
        f"{raised_where(error, r.function)}"
    )


def _culprit(calls: Calls, error: BaseException, workers: Workers) -> RewardError:
    """A batch call's error, named with its sample: found by calling again one sample at a time, each call
    within its deadline (an async function's on the run's loop)."""
    r, completions = calls.r, calls.completions
    for i in range(len(completions)):

        def alone(i: int = i) -> Any:
            called = calls.alone(i).batch()
            if inspect.isawaitable(called):
                return workers.run(_awaited(called)).result(r.timeout or None)
            return called

        try:
            _within(r, workers, alone)
        except RewardError:  # a timeout alone: the batch's error stands
            break
        except Escaped as escaped:
            return _at_sample(r, i, completions, escaped.original)
        except BaseException as failure:
            if isinstance(failure, KeyboardInterrupt):
                raise
            return _at_sample(r, i, completions, failure)
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


def _within(r: Prepared, workers: Workers, call: Callable[[], T]) -> T:
    """``call()`` within ``r``'s deadline: run in the run's reward-calls thread, waited for at most
    r.timeout seconds (none: here, at once). Python cannot stop a running function from outside: a call
    that outlives its deadline is left behind in that thread, the next calls get a fresh one, and the run
    stops with the error (after a checkpoint); the thread, a daemon, ends with the process."""
    if not r.timeout:
        return call()
    calls = workers.stage("reward-calls")
    future = calls.submit(call)
    try:
        return future.result(r.timeout)
    except concurrent.futures.TimeoutError:
        if future.done():  # the function's own TimeoutError
            raise
    calls.replace()
    raise _too_slow(r)


async def _gather(
    rewards: list[Prepared],
    prompts: list[Any],
    completions: list[Any],
    fields: dict[str, list],
    keywords: Keywords | None,
    workers: Workers,
) -> dict[str, list[Any] | BaseException]:
    """The concurrent functions' values (or errors), every call on the loop at once, at most each one's
    concurrency of its calls in flight."""
    results = await asyncio.gather(
        *(_concurrent(r.calls(prompts, completions, fields, keywords), workers) for r in rewards),
        return_exceptions=True,
    )
    return {r.name: _own_error(r, result) for r, result in zip(rewards, results, strict=True)}


def _own_error(r: Prepared, result: Any) -> Any:
    """A KeyboardInterrupt carried out of the loop is one again; any other escaped BaseException is the
    function's failure."""
    if isinstance(result, Escaped):
        if isinstance(result.original, KeyboardInterrupt):
            return result.original
        return RewardError(
            f"reward function {r.name!r} {raised(result.original)}{raised_where(result.original, r.function)}"
        )
    return result


async def _concurrent(calls: Calls, workers: Workers) -> list[Any]:
    r, completions = calls.r, calls.completions
    limit = asyncio.Semaphore(r.concurrency)

    async def run(call: Callable[[], Any]) -> Any:
        async with limit:
            if r.is_async:
                waited = _contained(call())
            else:
                waited = _contained(asyncio.wrap_future(workers.pool(r.concurrency).submit(call)))
            try:
                return await asyncio.wait_for(waited, r.timeout or None)
            except TimeoutError:
                if not r.is_async:  # its thread is stuck in the call: the pool's next calls get fresh ones
                    workers.pool(r.concurrency).replace()
                raise _too_slow(r) from None

    if r.per_completion:

        async def one(i: int) -> Any:
            try:
                return await run(lambda: calls.one(i))
            except (RewardError, asyncio.CancelledError):
                raise
            except Escaped as escaped:
                if isinstance(escaped.original, KeyboardInterrupt):
                    raise
                raise _at_sample(r, i, completions, escaped.original) from None
            except Exception as error:
                raise _at_sample(r, i, completions, error) from error

        return list(await asyncio.gather(*(one(i) for i in range(len(completions)))))
    try:
        return await run(calls.batch)
    except (RewardError, asyncio.CancelledError):
        raise
    except Escaped as escaped:
        if isinstance(escaped.original, KeyboardInterrupt):
            raise
        error: BaseException = escaped.original
    except Exception as failure:
        error = failure
    culprit = workers.pool(1).submit(lambda: _culprit(calls, error, workers))
    raise await asyncio.wrap_future(culprit) from error


async def _contained(awaitable: Any) -> Any:
    """``awaitable``'s result, with a BaseException raised inside it (SystemExit, KeyboardInterrupt, a
    subclass of the user's) carried as `Escaped`: raised in a task on the loop, it would stop the loop."""
    try:
        return await awaitable
    except (Exception, asyncio.CancelledError):
        raise
    except BaseException as error:
        raise Escaped(error) from error


# ---- the checked values, combined -----------------------------------------------------------------------
def _excerpt(completion: Any) -> str:
    text = str(completion)
    return repr(text[:80]) + ("..." if len(text) > 80 else "")


def _shown(value: Any) -> str:
    """A returned value as a message shows it: a huge int by its size, anything else by its repr, cut."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an int of {len(str(abs(value)))} digits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_values(name: str, values: Any, completions: list[Any]) -> list[float | None]:
    """A function's values as floats: one finite number per completion (a list, a tuple, a tensor or a numpy
    array; not a boolean), within float32's range, or None where it scores no such sample."""
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
        if value is None:  # no score for this sample (TRL's multi-task rewards): left out of the sum
            continue
        if isinstance(value, bool):  # a bool is an int to Python, but "passed?" is no amount of reward
            raise RewardError(
                f"reward function {name!r} returned {value!r} at sample {index} "
                f"(completion {_excerpt(completions[index])}); rewards are numbers, not booleans: return "
                "1.0 or 0.0 (float(passed))"
            )
        if not isinstance(value, numbers.Real):
            raise RewardError(
                f"reward function {name!r} returned {_shown(value)} at sample {index} "
                f"(completion {_excerpt(completions[index])}); rewards must be finite numbers"
            )
        try:
            finite = math.isfinite(value)
        except OverflowError:  # an int too large for a float: beyond float32's range too
            finite = True
        if not finite:
            raise RewardError(
                f"reward function {name!r} returned {value!r} at sample {index} "
                f"(completion {_excerpt(completions[index])}); rewards must be finite numbers"
            )
        if abs(value) > _FLOAT32_MAX:
            raise RewardError(
                f"reward function {name!r} returned {_shown(value)} at sample {index} "
                f"(completion {_excerpt(completions[index])}), beyond float32's range (about 3.4e38), "
                "in which rewards are combined; return smaller values"
            )
    return [None if value is None else float(value) for value in values]
