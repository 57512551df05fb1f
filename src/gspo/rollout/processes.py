"""Server processes that gspo starts die with the process that started them."""

from __future__ import annotations

import ctypes
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
"""prctl's option (linux/prctl.h): the signal a process gets when the thread that started it ends."""


def die_with_parent() -> None:
    """In a child process before exec (Linux): SIGTERM it when the thread that started it ends, even by
    SIGKILL, so that a killed run leaves no server holding the model's memory."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


PREEXEC: Callable[[], None] | None = die_with_parent if sys.platform == "linux" else None
"""``subprocess.Popen(preexec_fn=PREEXEC)`` for a server gspo starts (None where prctl does not exist)."""
