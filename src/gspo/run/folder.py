"""A run's folder: chosen, checked and locked before anything is written (gspo.run.lock), resumed
from its newest complete checkpoint, or prepared for a run that starts at step 0.

A new run needs an empty or new folder, or one of gspo's own runs stopped before its first checkpoint
(which restarts from scratch). A folder holding only incomplete checkpoints is refused rather than
started again: gspo deletes nothing it did not write completely (docs/reliability.md).
"""

from __future__ import annotations

import shutil
import sys
from datetime import datetime
from pathlib import Path

from gspo.config import Config
from gspo.files import replace_file, run_path
from gspo.parallel.collectives import broadcast_object
from gspo.parallel.group import is_main
from gspo.run.checkpoint import (
    CheckpointError,
    checkpoint_step,
    find_checkpoint,
    incomplete_checkpoints,
    latest_checkpoint,
)
from gspo.run.lock import LOCK_FILE, RunInUse, acquire, command_line
from gspo.run.resume import RUN_FILES, RUN_MARKER, RunFolderError, check_resume_config, nothing_to_resume


def setup_run_dir(
    config: Config,
    resume: str | Path | None,
    *,
    force: bool = False,
    from_step: int | None = None,
    command: str = "gspo train",
) -> tuple[Path, Path | None]:
    """The run folder and, when resuming, its latest complete checkpoint (its config checked against the
    requested one: gspo.run.resume), then the folder locked for this process (gspo.run.lock).
    A new run's folder is only checked: `start_fresh` creates and locks it once the run's inputs are
    checked. A refused run writes nothing. `from_step`: resume that step's checkpoint, not the latest.

    A new run needs an empty or new folder, or one of gspo's own runs stopped before its first
    checkpoint (which restarts from scratch); resuming such a run restarts it the same way. `command`:
    what a refusal tells the user to continue a run with (`gspo serve` continues a served run).
    """
    if resume is None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        # rank 0's name: the ranks' clocks may straddle a second
        run_dir = Path(broadcast_object(config.output_dir or f"runs/{config.train.objective}-{stamp}"))
        # rank 0 decides, before anyone writes: the others would see its first files
        refusal = broadcast_object(_new_run_refusal(run_dir, command) if is_main() else None)
        if refusal is not None:
            raise RunFolderError(refusal)
        return run_dir, None
    run_dir = Path(resume)
    checkpoint = _resume_point(run_dir, config, force=force, from_step=from_step)
    refusal = broadcast_object(_lock(run_dir) if is_main() else None)
    if refusal is not None:
        raise RunFolderError(refusal)
    # a run that ended just before the lock saved another
    if from_step is None and latest_checkpoint(run_dir) != checkpoint:
        checkpoint = _resume_point(run_dir, config, force=force)
    for folder, why in incomplete_checkpoints(run_dir, after=_step(checkpoint)) if is_main() else ():
        print(
            f"note: {folder} is incomplete ({why}): resuming from {checkpoint}; it is kept", file=sys.stderr
        )
    return run_dir, checkpoint


def _step(checkpoint: Path | None) -> int:
    return -1 if checkpoint is None else checkpoint_step(checkpoint)


def _resume_point(run_dir: Path, config: Config, *, force: bool, from_step: int | None = None) -> Path | None:
    """The complete checkpoint to resume, the latest or that of `from_step` (None: a gspo run stopped
    before its first one), its config checked; read-only."""
    checkpoint = latest_checkpoint(run_dir) if from_step is None else find_checkpoint(run_dir, from_step)
    if checkpoint is None and not (run_dir / RUN_MARKER).is_file():
        raise RunFolderError(nothing_to_resume(run_dir))
    refusal = _only_incomplete(run_dir) if checkpoint is None else None
    if refusal is not None:
        raise RunFolderError(refusal)
    if checkpoint is not None:
        check_resume_config(checkpoint, config, force=force)
    return checkpoint


def _only_incomplete(run_dir: Path) -> str | None:
    """A run without a complete checkpoint would start again, removing its checkpoints folder: refused
    while that holds an incomplete checkpoint, which gspo did not write (it renames only whole ones)."""
    incomplete = incomplete_checkpoints(run_dir)
    if not incomplete:
        return None
    folder, why = incomplete[0]
    return (
        f"{run_dir} has no complete checkpoint, only incomplete ones ({folder.name}: {why}); gspo deletes "
        f"nothing it did not write completely: move them out of {run_dir / 'checkpoints'} to start the run "
        "again, or choose another output_dir"
    )


def _lock(run_dir: Path) -> str | None:
    try:
        acquire(run_dir, command_line())
    except RunInUse as error:
        return str(error)
    return None


def _claim_new_run(run_dir: Path, command: str) -> str | None:
    """Why a new run may not use `run_dir`, or None with the folder created and locked. Checked before
    the lock (nothing is written into a folder that is refused) and again under it (another process may
    have started a run there in between)."""
    refusal = _new_run_refusal(run_dir, command)
    if refusal is not None:
        return refusal
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # created as a file in between
        return _new_run_refusal(run_dir, command)
    return _lock(run_dir) or _new_run_refusal(run_dir, command)


def _new_run_refusal(run_dir: Path, command: str) -> str | None:
    if run_dir.exists() and not run_dir.is_dir():
        return f"output_dir={str(run_dir)!r} is a file, not a folder: choose another output_dir"
    try:
        latest = latest_checkpoint(run_dir)
    except CheckpointError as error:
        return str(error)
    if latest is not None:
        return (
            f"{run_dir} already holds a run: continue it with `{command} --resume {run_dir}` or choose "
            "another output_dir"
        )
    if run_dir.is_dir() and (run_dir / RUN_MARKER).is_file() and (refusal := _only_incomplete(run_dir)):
        return refusal
    found = sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_FILE) if run_dir.is_dir() else []
    if found and not (run_dir / RUN_MARKER).is_file():
        return (
            f"{run_dir} is not empty and is not a gspo run (it holds {found[:5]}"
            f"{' ...' if len(found) > 5 else ''}): choose a new or empty output_dir; gspo overwrites "
            "nothing it did not write"
        )
    return None


def start_fresh(run_dir: Path, command: str = "gspo train") -> None:
    """Create and lock the run folder of a run that starts at step 0 (on every rank: rank 0 does it, and
    its refusal reaches all), and mark it as gspo's; a gspo run stopped before its first checkpoint loses
    the files it wrote, so that the new run's metrics start clean."""
    refusal = broadcast_object(_claim_new_run(run_dir, command) if is_main() else None)
    if refusal is not None:
        raise RunFolderError(refusal)
    if not is_main():
        return
    for name in RUN_FILES:
        path = run_path(run_dir, name)
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    replace_file(
        run_path(run_dir, RUN_MARKER), "a gspo run folder: gspo train writes here, --resume continues it\n"
    )
