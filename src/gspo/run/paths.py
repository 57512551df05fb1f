"""Paths under a run folder, checked before gspo reads or writes them: a run folder may come from someone
else, and a symbolic link planted in it (``summary.md -> ~/.bashrc``, ``evals -> /elsewhere``) would make
gspo write, or read, outside it.

Every file and folder gspo opens under a run folder is named through `run_path`, which refuses a path that
is a link, passes through one, or leads outside the folder. The run folder itself may be a link (a user's
``runs -> /big/disk``): it is the user's choice, not the folder's content (docs/reliability.md).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path


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
