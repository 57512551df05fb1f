"""A per-user record of the runs this user started with code files of their own (reward functions and
objectives named "file.py:function") or with servers and paths outside the run folder (gspo.run.trust's
`REACHES`: rollout.vllm.url, task.data_path, ...), so that `gspo train --resume RUN` and `gspo eval RUN` of
such a run need no `rewards={...}`, `key=value` or `--trust-run-folder` on the same machine while those files
and values are unchanged (gspo.run.trust).

The record lives outside run folders, which travel: $XDG_STATE_HOME/gspo/own_runs.json (by default
~/.local/state/gspo/), mapping each resolved run folder to the resolved path and sha256 of each code file
its run was started with, and to the value of each such key (by its dotted name). A folder copied elsewhere
resolves to another path, an edited file hashes to another digest, and an edited config.yaml names another
value: none matches. A store that another user owns, or that others may write, is ignored and not written.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import stat
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

STORE_FILE = "own_runs.json"


def store_dir() -> Path:
    """$XDG_STATE_HOME/gspo, or ~/.local/state/gspo (the XDG spec ignores a relative XDG_STATE_HOME)."""
    base = os.environ.get("XDG_STATE_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".local" / "state") / "gspo"


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _untrusted(path: Path) -> str | None:
    """Why `path` cannot be taken as this user's own record, or None: another user owns it, or others may
    write it (anyone who could edit it could vouch for their own code in this user's name)."""
    info = path.stat()
    if info.st_uid != os.getuid():
        return f"{path} belongs to another user (uid {info.st_uid})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def recorded_files(run_dir: str | Path) -> tuple[dict[str, str], str | None]:
    """(resolved code file -> sha256, and dotted config key -> value) recorded for `run_dir` (empty when
    none), and why the store was ignored (None when it was read or is absent)."""
    directory = store_dir()
    store = directory / STORE_FILE
    if not store.is_file():
        return {}, None
    problem = _untrusted(directory) or _untrusted(store)
    if problem is not None:
        return {}, f"gspo's record of your runs is ignored: {problem}"
    runs = _read(store)
    return runs.get(str(Path(run_dir).resolve()), {}), None


def record(
    run_dir: str | Path, files: Iterable[Path], settings: Mapping[str, str] | None = None
) -> str | None:
    """Add `files` (their resolved paths and sha256) and `settings` (dotted config key -> value) to
    `run_dir`'s record, and forget the records of run folders that no longer exist. Returns why nothing was
    recorded, or None. Written to a temporary file and renamed into place (mode 0600, folder 0700), under a
    lock on the folder: concurrent runs add their own."""
    files = [Path(file).resolve() for file in files]
    settings = dict(settings or {})
    if not files and not settings:
        return None
    directory = store_dir()
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        problem = _untrusted(directory)
        if problem is not None:
            return problem
        with _locked(directory):
            store = directory / STORE_FILE
            if store.is_file() and (problem := _untrusted(store)) is not None:
                return problem
            runs = {run: entry for run, entry in _read(store).items() if Path(run).is_dir()}
            key = str(Path(run_dir).resolve())
            runs[key] = runs.get(key, {}) | {str(file): file_digest(file) for file in files} | settings
            tmp = directory / f".{STORE_FILE}.{os.getpid()}.tmp"
            tmp.unlink(missing_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                json.dump(runs, out, indent=1)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, store)
    except OSError as error:
        return f"cannot write {directory / STORE_FILE}: {error.strerror or error}"
    return None


def _read(store: Path) -> dict[str, dict[str, str]]:
    """The store's runs; an absent, unreadable or malformed store records nothing."""
    with contextlib.suppress(OSError, ValueError):
        runs = json.loads(store.read_text())
        if isinstance(runs, dict) and all(isinstance(entry, dict) for entry in runs.values()):
            return runs
    return {}


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
