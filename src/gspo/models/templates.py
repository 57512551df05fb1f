"""Chat templates from a folder are data: a template that comes with a checkpoint or a model folder renders
in a process of its own, under a time and a memory budget (`TEMPLATE_SECONDS`, `TEMPLATE_MEMORY`), or is
refused with one line (`TemplateError`, an input error).

A chat template is Jinja code. transformers renders it in Jinja's sandbox, which stops attribute tricks (a
sandbox escape is a `SecurityError`) but not work: a planted `chat_template.jinja` with nested loops made
`gspo eval RUN` run for 90 s until killed, at 5.3 GB. Here the tokenizer's `apply_chat_template` is
replaced by a call to a child forked at the tokenizer's first render, which renders with the address-space
limit and answers within the deadline, or is killed (and forked again for the next render). A render costs
one round trip on a pipe (tens of microseconds).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import resource
import select
import signal
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

TEMPLATE_SECONDS = 10.0
"""How long one render of a folder's chat template may take (a chat model's renders take milliseconds)."""
TEMPLATE_MEMORY = 2**30
"""How much memory one render may add, in bytes."""


class TemplateError(ValueError):
    """A chat template from a folder broke its budget or Jinja's sandbox; the message names the folder."""


def _read(fd: int, size: int, deadline: float | None) -> bytes:
    """Exactly `size` bytes from `fd`, waiting until the monotonic `deadline` at most; b"" on end of file."""
    chunks, got = [], 0
    while got < size:
        if deadline is not None and not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            raise TimeoutError
        chunk = os.read(fd, size - got)
        if not chunk:
            return b""
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _send(fd: int, value: Any) -> None:
    data = pickle.dumps(value)
    os.write(fd, struct.pack("<Q", len(data)))
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _receive(fd: int, deadline: float | None = None) -> Any:
    header = _read(fd, 8, deadline)
    if not header:
        raise EOFError
    # from our own forked child (or its parent): what a template renders is text, never a pickle of its own
    return pickle.loads(_read(fd, struct.unpack("<Q", header)[0], deadline))


def _serve(render: Callable[..., Any], requests: int, answers: int) -> None:
    """The child: render each request under the memory limit and send back ("ok", result) or ("error",
    its one-line text); never returns. It keeps no descriptor but its two pipe ends, so it ends when the
    parent does (its requests end at end of file) and holds nothing of the parent's (a socket, a lock)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    for name in os.listdir("/proc/self/fd"):
        if int(name) > 2 and int(name) not in (requests, answers):
            with contextlib.suppress(OSError):
                os.close(int(name))
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    soft = _address_space() + TEMPLATE_MEMORY
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(
            resource.RLIMIT_AS, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard)
        )
    while True:
        try:
            args, kwargs = _receive(requests)
        except EOFError:
            os._exit(0)
        try:
            answer = ("ok", render(*args, **kwargs))
        except MemoryError:
            answer = ("memory", "")
        except Exception as error:  # the template's own error, or the sandbox's
            answer = ("error", f"{type(error).__name__}: {' '.join(str(error).split())[:300]}")
        try:
            _send(answers, answer)
        except MemoryError:
            _send(answers, ("memory", ""))


def _address_space() -> int:
    """This process's virtual size in bytes (what RLIMIT_AS limits)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


class BoundedRender:
    """A tokenizer's `apply_chat_template`, rendered by a forked child under the budget (module docstring).
    `source`: where the template came from, for messages."""

    def __init__(self, render: Callable[..., Any], source: str) -> None:
        self.render, self.source = render, source
        self.pid: int | None = None  # forked at the first render: the tokenizer is whole by then
        self.lock = threading.Lock()

    def _fork(self) -> None:
        requests_read, requests_write = os.pipe()
        answers_read, answers_write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: keeps only its two ends
            try:
                os.close(requests_write)
                os.close(answers_read)
                _serve(self.render, requests_read, answers_write)
            finally:
                os._exit(1)
        os.close(requests_read)
        os.close(answers_write)
        self.pid, self.requests, self.answers = pid, requests_write, answers_read
        self._finalizer = weakref.finalize(self, _stop, pid, requests_write, answers_read)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            if self.pid is None:
                self._fork()
            # the child's tokenizer is the one of its fork: the template is sent as it is now
            template = getattr(self.render.__self__, "chat_template", None)
            if isinstance(template, str):
                kwargs.setdefault("chat_template", template)
            _send(self.requests, (args, kwargs))
            try:
                status, result = _receive(self.answers, time.monotonic() + TEMPLATE_SECONDS)
            except (TimeoutError, EOFError) as error:
                self._finalizer()  # killed: the next render forks a fresh child
                self.pid = None
                why = (
                    f"did not render within {TEMPLATE_SECONDS:g} s"
                    if isinstance(error, TimeoutError)
                    else "crashed"
                )
                raise TemplateError(self._refusal(why)) from None
        if status == "ok":
            return result
        if status == "memory":
            raise TemplateError(self._refusal(f"needed more than {TEMPLATE_MEMORY / 2**30:g} GiB to render"))
        raise TemplateError(self._refusal(f"failed: {result}"))

    def __deepcopy__(self, memo: dict[int, Any]) -> BoundedRender:
        """A copied tokenizer renders under the budget too, by a child of its own."""
        tokenizer = self.render.__self__
        copied = memo.get(id(tokenizer), tokenizer)
        return BoundedRender(type(tokenizer).apply_chat_template.__get__(copied), self.source)

    def _refusal(self, why: str) -> str:
        return (
            f"the chat template of {self.source} {why}: a template from a folder is data, rendered under a "
            "budget; replace its chat_template.jinja (or tokenizer_config.json's chat_template) with a plain one"
        )


def _stop(pid: int, *fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    with contextlib.suppress(ProcessLookupError, ChildProcessError):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def bound_chat_template(tokenizer: Any, source: str) -> Any:
    """`tokenizer` with its chat template (when it has one) rendered under the budget (module docstring);
    `source` names the folder it came from. Returns the tokenizer."""
    if getattr(tokenizer, "chat_template", None) and sys.platform == "linux":
        tokenizer.apply_chat_template = BoundedRender(tokenizer.apply_chat_template, source)
    return tokenizer
