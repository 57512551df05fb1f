"""One request's samples as they are drawn: their tokens, text (stop strings applied) and records.

`Choice` follows one sample: each drawn token is appended with its log-prob and policy version, the text
is decoded again (held back where it might still become a stop string or ends inside a character), and a
stop string ends the choice there: its text stops before the string, its tokens keep the one that
completed it (what the model produced; the template's end-of-turn token is then context in the next turn).
`follow` waits for a request's tokens with a deadline, and cancels the request when its client is gone,
when it times out, or when every choice has ended on a stop string. `store` keeps a finished choice as the
`Record` a train call names.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from gspo.sampling.driver import Driver, Handle, Token
from gspo.serve.chat import parse_tool_calls, turn_key
from gspo.serve.protocol import ServeError
from gspo.serve.records import Record, RecordStore, float_array, new_completion_id, token_array

DISCONNECT_CHECK = 0.5
"""Seconds between checks that a client waiting for a whole answer is still connected."""


@dataclass
class Choice:
    """One sample of a request, as far as it has been drawn."""

    index: int
    completion_id: str = field(default_factory=new_completion_id)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0
    """Characters of `text` already streamed."""
    sent_tokens: int = 0
    """Tokens already streamed."""
    finish_reason: str | None = None
    stop_token: bool = False
    """It ended on a stop token (kept in `tokens`, not in `text`)."""
    reported: bool = False
    """Its end has been sent (streaming)."""

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Decoder:
    """Turns a choice's tokens into text: special tokens skipped, stop strings applied."""

    tokenizer: Any
    stop: list[str]
    stop_ids: frozenset[int]

    def add(self, choices: list[Choice], tokens: list[Token]) -> None:
        """Record drawn tokens in their choices (a token of a choice that has ended is ignored), then decode
        each choice's text once. A stop string ends a choice at the token that completed it when its tokens
        come one step at a time: a request with stop strings gets them so (`Handle.at_end` off)."""
        added: dict[int, Choice] = {}
        for token in tokens:
            choice = choices[token.index]
            if choice.done:
                continue
            if token.token < 0:  # cancelled before it ended: the client is gone or a stop string ended it
                choice.finish_reason = "cancelled"
                continue
            choice.tokens.append(token.token)
            choice.logprobs.append(token.logprob)
            if token.top is not None:
                choice.tops.append(token.top)
            choice.versions.append(token.version)
            choice.stop_token = token.finish_reason == "stop" and token.token in self.stop_ids
            choice.finish_reason = token.finish_reason
            added[token.index] = choice
        for choice in added.values():  # the text: special tokens and a final stop token left out
            shown = choice.tokens[:-1] if choice.stop_token else choice.tokens
            text = self.tokenizer.decode(shown, skip_special_tokens=True)
            hit = self._first_stop(text, len(choice.text))
            if hit is not None:
                text, choice.finish_reason = text[:hit], "stop"
            choice.text = text

    def _first_stop(self, text: str, previous: int) -> int | None:
        if not self.stop:
            return None
        start = max(0, previous - max(len(s) for s in self.stop) + 1)
        hits = [p for p in (text.find(s, start) for s in self.stop) if p >= 0]
        return min(hits) if hits else None

    def delta(self, choice: Choice) -> str:
        """The text not streamed yet that can no longer change: all of it once the choice has ended; before
        that, not a trailing partial character nor a tail that may still begin a stop string."""
        end = len(choice.text)
        if not choice.done:
            while end > choice.sent and choice.text[end - 1] == "\ufffd":
                end -= 1
            if self.stop:
                end = max(choice.sent, end - max(len(s) for s in self.stop) + 1)
        out = choice.text[choice.sent : end]
        choice.sent = end
        return out


async def follow(
    driver: Driver,
    handle: Handle,
    choices: list[Choice],
    decoder: Decoder,
    *,
    timeout: float,
    disconnected: Callable[[], Awaitable[bool]],
) -> AsyncIterator[None]:
    """Add the request's tokens to its `choices` as they come (a list per engine step, or one at the end:
    `Handle.at_end`), yielding after each list, until every choice has ended. Cancels the request when the
    caller stops iterating early, after `timeout` seconds (ServeError 504), when `disconnected()`, or when
    the choices have ended on stop strings before the engine ended them. Every caller checks for a
    disconnect: a check time left in the past (streams once passed none) made every wait 0 s, and
    wait_for(queue.get(), 0) cancels the get before it runs, so a stream whose first token came later than
    DISCONNECT_CHECK never got one."""
    ended: set[int] = set()  # the samples the engine has ended
    now = time.monotonic()
    deadline, check = now + timeout, now + DISCONNECT_CHECK
    try:
        while True:
            now = time.monotonic()
            if now >= check:  # on a clock: tokens may arrive every few ms
                if await disconnected():
                    return
                check = now + DISCONNECT_CHECK
            try:
                item = await asyncio.wait_for(handle.queue.get(), max(min(deadline, check) - now, 0.0))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise ServeError(
                        504,
                        "the request took longer than serve.request_timeout; it was cancelled",
                        code="timeout",
                    ) from None
                continue
            if isinstance(item, BaseException):
                raise ServeError(503, f"{item}", code="engine_error") from None
            ended.update(t.index for t in item if t.finish_reason is not None)
            decoder.add(choices, item)
            yield
            if all(c.done for c in choices):
                return
    finally:
        if len(ended) < handle.n:
            driver.cancel(handle)


async def collect(
    driver: Driver,
    handle: Handle,
    decoder: Decoder,
    *,
    timeout: float,
    disconnected: Callable[[], Awaitable[bool]],
) -> list[Choice]:
    """All of a request's choices, run to their end (stop strings, limits); [] if the client left."""
    choices = [Choice(i) for i in range(handle.n)]
    steps = follow(driver, handle, choices, decoder, timeout=timeout, disconnected=disconnected)
    async with contextlib.aclosing(steps):
        async for _ in steps:
            pass
    return choices if all(c.done for c in choices) else []


def store(
    records: RecordStore, handle: Handle, choice: Choice, *, tools: bool
) -> tuple[str, list[dict[str, Any]]]:
    """Record a finished choice of `handle`'s request (its finish_reason becomes its record's) and return
    the content and tool calls its response shows; a choice whose log-probs are not finite (a numerical
    fault in the engine) is refused, not recorded."""
    if not all(math.isfinite(lp) for lp in choice.logprobs):
        raise ServeError(
            500,
            "the sampling engine produced non-finite log-probs; the completion was dropped",
            code="engine_error",
        )
    content, calls = parse_tool_calls(choice.text) if tools else (choice.text, [])
    reason = choice.finish_reason or "stop"
    if reason == "cancelled":  # cancelled by us after a stop string; a client that left gets no record
        reason = "stop"
    if calls:
        reason = "tool_calls"
    records.add(
        Record(
            id=choice.completion_id,
            prompt_ids=token_array(handle.prompt_ids),
            completion_ids=token_array(choice.tokens),
            logprobs=float_array(choice.logprobs),
            versions=(min(choice.versions, default=0), max(choice.versions, default=0)),
            temperature=handle.params.temperature,
            greedy=handle.params.greedy,
            content=turn_key(content, calls),
            finish_reason=reason,
        )
    )
    choice.finish_reason = reason
    return content, calls
