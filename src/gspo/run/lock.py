"""One writer per run folder: an exclusive OS file lock (``flock`` on ``RUN/.gspo_lock``) held while a
process trains the run, and released by the kernel when the process ends, however it ends.

The lock file records its holder (pid, host, command, start time), so that a second process is refused
with an error naming it. A process that exits, on an exception too, clears the record of every lock it
still holds (atexit: a Python session that trained a `Trainer` which raised keeps its lock until then). A
holder killed with SIGKILL cannot: the next process gets the lock (the kernel released it) and says that
it takes over from a process that ended without releasing it.

Under torchrun only rank 0 (the rank that writes) holds the lock; the others learn its outcome by a
broadcast (gspo.run.folder). Readers (`gspo eval`, `gspo export`) take no lock: they read complete
checkpoints only and write into their own folders (docs/reliability.md). Within one process the lock is
re-entrant (a Python session may train, then resume, the same run).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import socket
import stat
import sys
import time
from pathlib import Path
from typing import Any

from gspo.files import RunPathError, run_path

LOCK_FILE = ".gspo_lock"

_held: dict[Path, int] = {}
"""This process's locks: the run folder (resolved) -> the lock file's descriptor."""


class RunInUse(RuntimeError):
    """Another process holds the run folder's lock; the message names it."""


def _holder(fd: int) -> dict[str, Any] | None:
    """The record in the lock file, or None when it is empty (released) or unreadable (half-written)."""
    with contextlib.suppress(OSError, ValueError):
        data = os.pread(fd, 4096, 0)
        record = json.loads(data) if data.strip() else None
        return record if isinstance(record, dict) else None
    return None


def _describe(record: dict[str, Any] | None) -> str:
    if record is None:
        return "another process"
    return (
        f"pid {record.get('pid')} on {record.get('host')} (`{record.get('command')}`, since "
        f"{record.get('since')})"
    )


def acquire(run_dir: str | Path, command: str) -> None:
    """Take `run_dir`'s lock for this process, or raise RunInUse naming the holder. O(1): one open, one
    flock, one small write. A note on stderr when the previous holder ended without releasing it."""
    run_dir = Path(run_dir)
    key = run_dir.resolve()
    if key in _held:
        return
    fd = _open_lock_file(run_path(run_dir, LOCK_FILE))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        for _ in range(25):  # a holder that has just locked writes its record a moment later
            if holder is not None:
                break
            time.sleep(0.02)
            holder = _holder(fd)
        os.close(fd)
        raise RunInUse(
            f"{run_dir} is in use by {_describe(holder)}: one process writes a run folder at a time; wait for "
            "it to finish (or stop it), or choose another output_dir"
        ) from None
    previous = _holder(fd)
    if previous is not None:  # its holder never released it: killed, or its machine went down
        other_host = previous.get("host") != socket.gethostname()
        print(
            f"note: {run_dir}: the previous holder of its lock, {_describe(previous)}, ended without "
            "releasing it (killed, or its machine went down: a process that exits releases its locks); taking "
            f"it over{' (check that it is not running there)' if other_host else ''}",
            file=sys.stderr,
        )
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "command": command,
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    _held[key] = fd


@atexit.register
def _release_all() -> None:
    """At the interpreter's exit, normal or by an exception, every lock this process still holds: its
    record cleared, so the next holder finds a lock released, not one whose holder was killed."""
    for run_dir in list(_held):
        with contextlib.suppress(OSError):
            release(run_dir)


def _open_lock_file(path: Path) -> int:
    """The lock file, opened for writing its record. It is the one file gspo writes in place (a lock must
    stay one inode, so it cannot be replaced): it is written only when this is its one name, so a hard link
    planted there (to a file elsewhere) is refused before a byte of that file changes."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    info = os.fstat(fd)
    if stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
        return fd
    os.close(fd)
    raise RunPathError(
        f"{path} is not a file of gspo's own ({info.st_nlink} names: a hard link to a file elsewhere?): gspo "
        f"writes only its own files in a run folder; remove {path}"
    )


def release(run_dir: str | Path) -> None:
    """Clear the record and release the lock (no-op when this process does not hold it). The file stays:
    removing it would let a process that opened it lock a file no one else sees."""
    fd = _held.pop(Path(run_dir).resolve(), None)
    if fd is None:
        return
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def holder_if_locked(run_dir: str | Path) -> str | None:
    """Who holds `run_dir`'s lock when another process does, else None; creates no file."""
    path = run_path(run_dir, LOCK_FILE)
    if Path(run_dir).resolve() in _held or not path.is_file():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _describe(_holder(fd))
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def command_line() -> str:
    """This process's command, for the lock's record: `gspo train ...` or the Python script."""
    argv = [Path(sys.argv[0]).name, *sys.argv[1:]] if sys.argv and sys.argv[0] else ["python"]
    text = " ".join(argv)
    return text if len(text) <= 200 else text[:197] + "..."
