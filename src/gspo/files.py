"""How gspo touches files: paths under a run folder checked before they are read or written, and every write
made by replacement.

Paths: a run folder may come from someone else, and a symbolic link planted in it (``summary.md ->
~/.bashrc``, ``evals -> /elsewhere``) would make gspo write, or read, outside it. Every file and folder gspo
opens under a run folder is named through `run_path`, which refuses a path that is a link, passes through
one, or leads outside the folder. The run folder itself may be a link (a user's ``runs -> /big/disk``): it is
the user's choice, not the folder's content (docs/reliability.md).

Writes: every file gspo writes goes first to a new file beside its target, created
here (``O_EXCL``), and is then renamed over the target. A hard link or a symbolic link planted at the target
is replaced by the rename, never written through, so a file elsewhere that shares its inode stays as it was.
A write that fails removes its temporary file; one that fails because the disk is full says so, whatever
the library that wrote reported (docs/reliability.md, "Writes replace").

Below every layer that writes (models, rollout, run, training, serve): one way to write a file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

DISK_FULL_BELOW = 16 * 2**20
"""Free bytes under which a failed write is taken for a full disk: libraries report a short write without
an errno (numpy: "4096 requested and 2096 written"; torch: "unexpected pos"; safetensors: "write failed")."""


def temporary_beside(path: Path, suffix: str = ".tmp") -> Path:
    """``path`` + ``suffix``, created now as a new empty file of ours: a leftover of a killed write, or a
    link planted there, is removed first (never written through)."""
    tmp = path.with_name(path.name + suffix)
    tmp.unlink(missing_ok=True)
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
    return tmp


def write_error(error: BaseException, path: Path) -> BaseException:
    """The error to raise for a write of ``path`` that failed with ``error``: a full disk as ENOSPC, another
    short write without an errno as an OSError naming the file (gspo's disk kind), an OSError that names no
    file with ``path`` named, else ``error`` itself."""
    if isinstance(error, OSError) and error.errno:
        return error if error.filename else OSError(error.errno, error.strerror, str(path))
    if not isinstance(error, (OSError, RuntimeError)):
        return error
    with contextlib.suppress(OSError):
        if shutil.disk_usage(path.parent).free < DISK_FULL_BELOW:
            return OSError(errno.ENOSPC, f"No space left on device ({error})", str(path))
    if isinstance(error, OSError):
        return OSError(errno.EIO, f"the write failed ({error})", str(path))
    return error


@contextlib.contextmanager
def replacing(path: str | Path, *, sync: bool = False) -> Iterator[Path]:
    """A new temporary file beside ``path`` for the block to write (by its path: any library's writer), then
    renamed over ``path`` (fsynced first with ``sync``); removed when the block fails."""
    path = Path(path)
    tmp = temporary_beside(path)
    with _removed_on_failure(tmp):
        yield tmp
        if sync:
            fsync(tmp)
        os.replace(tmp, path)


def replace_file(path: str | Path, data: str | bytes, *, sync: bool = False) -> None:
    """Write ``data`` (text as UTF-8) as the new content of ``path``, by replacement."""
    with replacing(path, sync=sync) as tmp, open(tmp, "wb") as handle:  # ours, created by `replacing`
        handle.write(data.encode("utf-8") if isinstance(data, str) else data)
        if sync:
            handle.flush()
            os.fsync(handle.fileno())


def open_for_appending(path: str | Path, lines: Iterable[str] = ()) -> IO[str]:
    """``path`` replaced by a new file holding ``lines``, returned open for appending: a log appends only to
    a file this process created, never to one that was there (a hard link to a file elsewhere)."""
    path = Path(path)
    tmp = temporary_beside(path)
    handle = open(tmp, "a", encoding="utf-8")  # noqa: SIM115 (the caller closes it)
    with _removed_on_failure(tmp, handle):
        handle.writelines(lines)
        handle.flush()
        os.replace(tmp, path)
    return handle


@contextlib.contextmanager
def replacing_folder(path: str | Path) -> Iterator[Path]:
    """A new folder beside ``path`` for the block to fill, then put in place: renamed to ``path`` when that
    does not exist, else each of its files renamed over its namesake in ``path`` (the folder's other files
    stay). Removed when the block fails."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # our own leftover of an interrupted write
    tmp.mkdir(parents=True)
    with _removed_on_failure(tmp):
        yield tmp
        if not path.exists():
            os.replace(tmp, path)
            return
        for folder, _, files in os.walk(tmp):
            target = path / Path(folder).relative_to(tmp)
            target.mkdir(exist_ok=True)
            for name in files:
                os.replace(Path(folder, name), target / name)
        shutil.rmtree(tmp)


@contextlib.contextmanager
def _removed_on_failure(tmp: Path, handle: IO[str] | None = None) -> Iterator[None]:
    """The temporary file or folder (and its open ``handle``) removed when the block fails; the failure
    raised as `write_error` says it."""
    try:
        yield
    except BaseException as error:
        if handle is not None:
            handle.close()
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        translated = write_error(error, tmp)
        if translated is error:
            raise
        raise translated from error


def fsync(path: Path) -> None:
    """fsync a file or folder, so that a rename after it never exposes unwritten data (power loss)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RunPathError(RuntimeError):
    """A path under a run folder is a symbolic link, or leads outside the folder."""


class RunFolderGone(OSError):
    """The run folder was removed, moved or replaced while a run wrote into it: the disk's kind of error
    (exit code 6), not a missing input file."""


FolderIdentity = tuple[int, int]
"""(device, inode) of a folder: the same path may come to name another folder."""


def folder_identity(folder: str | Path) -> FolderIdentity:
    status = os.stat(folder)
    return status.st_dev, status.st_ino


def check_still_there(run_dir: Path, identity: FolderIdentity, cause: BaseException | None = None) -> None:
    """Raise RunFolderGone (from `cause`, a write that failed) unless `run_dir` is still the folder of
    `identity`. Writes into a removed folder fail, or (into a file open already: metrics.jsonl) succeed and
    are lost: checked before them, and after one fails, so that the run stops with that line rather than
    with a raw errno of the write."""
    try:
        same = folder_identity(run_dir) == identity
    except OSError:
        same = False
    if not same:
        raise RunFolderGone(
            errno.ENOENT,
            f"the run folder {run_dir} was removed, moved or replaced while the run wrote into it",
        ) from cause


def run_path(run_dir: str | Path, *parts: str | Path) -> Path:
    """``run_dir / parts``, after checking that no part of it below `run_dir` that exists is a symbolic
    link and that it resolves inside `run_dir`; raises RunPathError naming the path otherwise."""
    run_dir = Path(run_dir)
    path = run_dir.joinpath(*parts)
    current = run_dir
    for part in Path(*parts).parts if parts else ():
        current = current / part
        if current.is_symlink():
            raise RunPathError(
                f"{current} is a symbolic link (to {os.readlink(current)}): gspo reads and writes only "
                f"inside the run folder {run_dir}, never through a link in it; remove the link"
            )
    if Path(*parts).is_absolute() or not path.resolve().is_relative_to(run_dir.resolve()):
        raise RunPathError(
            f"{path} leads outside the run folder {run_dir}: gspo reads and writes only inside it"
        )
    return path


def run_tree(run_dir: str | Path, *parts: str | Path) -> Path:
    """`run_path` of a folder, and of everything in it (a checkpoint about to be read: its model files)."""
    folder = run_path(run_dir, *parts)
    for parent, folders, files in os.walk(folder):  # os.walk lists a linked folder, but does not enter it
        for name in [*folders, *files]:
            run_path(run_dir, Path(parent, name).relative_to(run_dir))
    return folder
