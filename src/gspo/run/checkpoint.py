"""Resumable checkpoints: model (or LoRA adapter), optimizer (unless checkpoint.optimizer=false), scheduler,
RNG states, step, data position.

Layout: RUN_DIR/checkpoints/step_000010/{model/, trainer_state.pt, config.yaml} and RUN_DIR/checkpoints/latest
(the name of the newest complete checkpoint). A checkpoint is written into a temporary folder, synced, and
renamed into place; `latest` is replaced atomically after that. A re-save of an existing step moves the
complete copy aside (``.old_step_...``) and only deletes it once the new copy is in place, so a SIGKILL at
any moment leaves a complete checkpoint that `latest_checkpoint` finds (docs/reliability.md). An incomplete
``step_*`` folder (gspo renames only complete ones: a damaged copy) is skipped, never pruned, and moved
aside to ``step_....incomplete`` if its step is saved again.

Each checkpoint ends with ``manifest.json``, written last: every file's size and sha256. Loading a
checkpoint (`verify_checkpoint`) checks them, so damaged weights are refused instead of trained or scored;
a checkpoint from before manifests loads with a note.

The training state holds tensors and plain data only (numpy's and Python's RNG states are converted), and
is read back with ``torch.load(weights_only=True)``: a planted pickle is refused, never executed.
"""

from __future__ import annotations

import errno
import os
import pickle
import random
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gspo.config import Config, save_config
from gspo.files import fsync, replace_file, run_path, run_tree, write_error
from gspo.learning.policy import Policy
from gspo.manifest import MANIFEST_FILE, listed_files, manifest_problem, write_manifest
from gspo.models import save_model
from gspo.models.loading import weights_problem
from gspo.parallel.group import is_main
from gspo.parallel.state import optimizer_state, savable_model

LATEST = "latest"
STATE_FILE = "trainer_state.pt"
CONFIG_FILE = "config.yaml"
SHARD_INDEX = "model/model.safetensors.index.json"
_NAME = re.compile(r"step_\d{6,}")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted or read: altered, corrupt, or not written by gspo."""


def rng_state() -> dict[str, Any]:
    """Every RNG a run draws from, as tensors and plain data: torch (CPU, and this process's current GPU
    once CUDA is in use; each torchrun rank saves its own), Python, numpy."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss},
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    python = state["python"]
    random.setstate((python["version"], tuple(python["internal"]), python["gauss_next"]))
    numpy = state["numpy"]
    keys = numpy["keys"].numpy().astype(np.uint32)
    np.random.set_state((numpy["kind"], keys, numpy["pos"], numpy["has_gauss"], numpy["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])  # the current GPU: the trainer selects it first


def _sync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            fsync(Path(folder) / name)
        fsync(Path(folder))


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model: Any,
    tokenizer: Any,
    state: dict[str, Any],
    keep: int = 1,
    config: Config | None = None,
) -> Path:
    """Write checkpoint `step` (model, `state`: tensors and plain data, and the run's resolved `config`),
    then prune all but the newest `keep` ones."""
    root = run_path(run_dir, "checkpoints")
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:06d}"
    final, tmp, aside = (run_path(root, part) for part in (name, f".tmp_{name}", f".old_{name}"))
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        save_model(model, tokenizer, tmp / "model")
        with open(tmp / STATE_FILE, "wb") as handle:  # streamed: no copy of the optimizer state in memory
            torch.save({**state, "step": step}, handle)
        if config is not None:
            save_config(config, tmp / CONFIG_FILE)
        _sync_tree(tmp)
        write_manifest(tmp)  # last: it vouches for all
        fsync(tmp)
    except Exception as error:
        shutil.rmtree(tmp, ignore_errors=True)
        # torch and safetensors report a full disk as a bare "write failed": say what it is
        translated = write_error(error, root / tmp.name)
        if translated is not error:
            raise translated from error
        raise
    problem = checkpoint_problem(final) if final.exists() else None
    if problem is not None:  # not gspo's (it renames only complete copies): kept
        kept = keep_aside(final)  # what it lacked is said before it moves (after, it lacks everything)
        print(f"note: {final} was incomplete ({problem}): moved to {kept.name}", file=sys.stderr)
    if final.exists():  # a re-save: keep the complete copy until the new one is in place
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    fsync(root)
    replace_file(run_path(root, LATEST), name, sync=True)
    # only complete checkpoints are pruned, and gspo's own temporary copies: an incomplete step_* folder
    # was not written by gspo and may hold the only copy of some weights
    complete = sorted(
        (p for p in root.iterdir() if _NAME.fullmatch(p.name) and p.is_dir() and is_complete(p)), key=_step_of
    )
    leftovers = [p for p in root.iterdir() if p.name.startswith((".tmp_", ".old_")) and p.is_dir()]
    for old in [*complete[:-keep], *leftovers]:
        shutil.rmtree(old, ignore_errors=True)
    return final


_unverified_noted: set[Path] = set()


def verify_checkpoint(checkpoint: Path) -> None:
    """Check every file of a checkpoint against its manifest (size and sha256) before it is loaded;
    raises CheckpointError naming the first file that is missing, added or changed. A checkpoint written
    before manifests existed is loaded with a note, once per process."""
    if not run_path(checkpoint, MANIFEST_FILE).is_file():
        if checkpoint not in _unverified_noted:
            _unverified_noted.add(checkpoint)
            print(
                f"note: {checkpoint} has no {MANIFEST_FILE} (written by a gspo before checkpoints had one): "
                "its files cannot be checked for damage",
                file=sys.stderr,
            )
        return
    run_tree(checkpoint.parent, checkpoint.name)  # a link in it: refused by name (RunPathError)
    problem = manifest_problem(checkpoint)
    if problem is not None:
        raise _damaged(checkpoint, *problem)


def _damaged(checkpoint: Path, file: Path, why: str) -> CheckpointError:
    step = int(re.findall(r"\d+", checkpoint.name)[-1])  # step_000040, or its copy .old_step_000040
    earlier = [s for s in _complete_steps(checkpoint.parent) if s < step]
    return CheckpointError(
        f"{file} is damaged: {why}; the checkpoint {checkpoint.name} cannot be trusted. Choose an earlier one: "
        f"`gspo train --resume RUN --from-step N`, `gspo eval`/`gspo export` `--step N` (earlier complete "
        f"steps: {earlier or 'none'})"
    )


def keep_aside(path: Path) -> Path:
    """Rename `path` to the first free `NAME.incomplete[-k]` beside it; returns the new path."""
    for k in range(1, 10_000):
        target = run_path(path.parent, f"{path.name}.incomplete" + (f"-{k}" if k > 1 else ""))
        if not target.exists():
            os.replace(path, target)
            return target
    raise FileExistsError(errno.EEXIST, f"no free name to keep {path} aside", str(path))


def _step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def checkpoint_problem(checkpoint: Path) -> str | None:
    """Why a checkpoint folder is not complete, or None: its training state, its model's (or LoRA
    adapter's) config, and whole safetensors weights (header and length checked, not the tensors). A link
    in it is refused (RunPathError): what it reads would lie outside the run folder."""
    run_tree(checkpoint.parent, checkpoint.name)
    model = checkpoint / "model"
    weights = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors")
    if not (checkpoint / STATE_FILE).is_file():
        return f"no {STATE_FILE}"
    if not ((model / "config.json").is_file() or (model / "adapter_config.json").is_file()):
        return "no model/config.json or model/adapter_config.json"
    if not any((model / w).is_file() for w in weights):
        return "no safetensors weights in model/"
    # a shard index the manifest does not list was added after gspo wrote the checkpoint: it is the
    # manifest's to refuse when the checkpoint is loaded (`verify_checkpoint`), by name
    listed = listed_files(checkpoint)
    return weights_problem(model, index=listed is None or SHARD_INDEX in listed)


def is_complete(checkpoint: Path) -> bool:
    return checkpoint_problem(checkpoint) is None


def incomplete_checkpoints(run_dir: str | Path, *, after: int = -1) -> list[tuple[Path, str]]:
    """(folder, why) of every incomplete ``step_*`` folder of a run whose step is above `after`."""
    root = run_path(run_dir, "checkpoints")
    if not root.is_dir():
        return []
    found = sorted((p for p in root.iterdir() if _NAME.fullmatch(p.name) and p.is_dir()), key=_step_of)
    return [(p, why) for p in found if _step_of(p) > after and (why := checkpoint_problem(p)) is not None]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run, or None.

    The one `latest` names (or its copy moved aside by an interrupted re-save); without a `latest`, or when
    it names a checkpoint that is gone, the newest complete ``step_*`` folder. A `latest` that holds
    anything but a checkpoint name (``step_NNNNNN``) is refused: it was altered.
    """
    root = run_path(run_dir, "checkpoints")
    pointer = run_path(root, LATEST)
    candidates: list[Path] = []
    if pointer.is_file():
        name = pointer.read_text().strip()
        if not _NAME.fullmatch(name):
            raise CheckpointError(
                f"{pointer} holds {name[:80]!r}, not a checkpoint name (step_NNNNNN): it was altered; "
                f"write the name of a folder in {root} into it, or delete it to use the newest one"
            )
        candidates += [run_path(root, name), run_path(root, f".old_{name}")]
    if root.is_dir():
        candidates += sorted(
            (p for p in root.iterdir() if _NAME.fullmatch(p.name)), key=_step_of, reverse=True
        )
    return next((p for p in candidates if p.is_dir() and is_complete(p)), None)


def find_checkpoint(run_dir: str | Path, step: int | None = None) -> Path:
    """A run's complete checkpoint of `step` (None: the latest, with a note on stderr for each newer one
    that is incomplete); the error says why a checkpoint is incomplete and lists the complete steps."""
    root = run_path(run_dir, "checkpoints")
    if step is None:
        found = latest_checkpoint(run_dir)
        for folder, why in incomplete_checkpoints(run_dir, after=-1 if found is None else _step_of(found)):
            print(f"note: skipping the incomplete checkpoint {folder} ({why})", file=sys.stderr)
    else:
        found = run_path(root, f"step_{step:06d}")
        why = checkpoint_problem(found) if found.is_dir() else None
        if why is not None:
            raise CheckpointError(f"{found} is incomplete ({why}): choose another --step ({_steps(root)})")
        found = found if found.is_dir() else None
    if found is None:
        raise CheckpointError(
            f"{run_dir}: no complete checkpoint {'' if step is None else f'of step {step} '}({_steps(root)}; "
            "checkpoint.keep sets how many a run keeps)"
        )
    return found


def _complete_steps(root: Path) -> list[int]:
    return sorted(_step_of(p) for p in root.glob("step_*") if _NAME.fullmatch(p.name) and is_complete(p))


def _steps(root: Path) -> str:
    return f"complete steps on disk: {_complete_steps(root) or 'none'}"


def inside_checkpoint(path: str | Path) -> Path | None:
    """The checkpoint folder (or a run's checkpoints/ folder) that `path` is or lies in, or None."""
    path = Path(path).resolve()
    for folder in (path, *path.parents):
        in_checkpoints = folder.parent.name == "checkpoints" and (
            _NAME.fullmatch(folder.name) or folder.name.startswith((".tmp_step_", ".old_step_"))
        )
        pointer = folder.name == "checkpoints" and (folder / LATEST).is_file()
        if in_checkpoints or pointer or (folder / STATE_FILE).is_file():
            return folder
    return None


def checkpoint_step(checkpoint: str | Path) -> int:
    """The step of a checkpoint folder, from its name (step_000040 -> 40)."""
    return int(Path(checkpoint).name.removeprefix("step_"))


def load_trainer_state(checkpoint: str | Path) -> dict[str, Any]:
    """A checkpoint's training state: tensors and plain data only (``weights_only=True``), never code."""
    path = run_path(checkpoint, STATE_FILE)
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"{path} holds more than tensors and plain data (a pickled object), so it is not loaded: "
            "gspo never writes such a file; it was altered, or written by a gspo older than its "
            f"safe-checkpoint format (start a new run from {Path(checkpoint) / 'model'} instead) "
            f"[{str(error).splitlines()[0][:200]}]"
        ) from None
    except (RuntimeError, EOFError) as error:
        raise CheckpointError(
            f"{path} cannot be read, it is truncated or corrupt ({str(error).splitlines()[0][:200]})"
        ) from error


def check_output(path: str | Path, *, force: bool) -> None:
    """Refuse to write `path` (a file or a folder an export writes) inside a checkpoint, ever (a resume
    would load what was written there), or over something that exists, unless `force`."""
    inside = inside_checkpoint(path)
    if inside is not None:
        raise CheckpointError(
            f"{path} is inside the checkpoint {inside}: gspo never writes into a checkpoint (a resume would "
            "load it); choose another --output"
        )
    if Path(path).exists() and not force:
        raise FileExistsError(
            f"{path} exists, and gspo overwrites nothing it did not write: choose another --output, or pass "
            "--force to write over it"
        )


def save_policy(
    run_dir: Path,
    step: int,
    policy: Policy,
    tokenizer: Any,
    config: Config,
    *,
    rng: dict[str, Any] | None = None,
    **extra: Any,
) -> Path | None:
    """A checkpoint of ``policy`` at ``step``, for `gspo train` and `gspo serve` alike: the weights (FSDP2:
    gathered on rank 0), the optimizer (gathered; left out with checkpoint.optimizer=false), the schedule,
    ``rng`` (default: now) and ``extra`` (the prompt stream, the ranks' states, the server's version). Every
    rank calls it; rank 0 writes and returns the checkpoint's path."""
    state = {
        "scheduler": policy.scheduler.state_dict(),
        "entropy": policy.entropy.state_dict(),
        "rng": rng if rng is not None else rng_state(),
        **extra,
    }
    if config.checkpoint.optimizer:  # what an exact resume needs, twice the weights' size
        state["optimizer"] = optimizer_state(policy.model, policy.optimizer)
    model = savable_model(policy.scorer, policy.model)
    if not is_main():
        return None
    return save_checkpoint(
        run_dir,
        step,
        model=model,
        tokenizer=tokenizer,
        state=state,
        keep=config.checkpoint.keep,
        config=config,
    )
