"""Resumable checkpoints: model (or LoRA adapter), optimizer, scheduler, RNG states, step, data position.

Layout: RUN_DIR/checkpoints/step_000010/{model/, trainer_state.pt} and RUN_DIR/checkpoints/latest
(the name of the newest complete checkpoint). A checkpoint is written into a temporary folder and renamed
into place, and `latest` is replaced atomically after that, so a SIGKILL at any moment leaves the previous
checkpoint intact and `latest` pointing at a complete one.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gspo.models import save_model


def rng_state() -> dict[str, Any]:
    """Every RNG a run draws from: torch (CPU, and this process's current GPU once CUDA is in use; each
    torchrun rank saves its own), Python, numpy."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])  # the current GPU: the trainer selects it first


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(
    run_dir: str | Path, step: int, *, model: Any, tokenizer: Any, state: dict[str, Any], keep: int = 1
) -> Path:
    """Write checkpoint `step` (model + `state`, a dict of picklable trainer state) and prune old ones."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_model(model, tokenizer, tmp / "model")
    torch.save({**state, "step": step}, tmp / "trainer_state.pt")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _atomic_write(root / "latest", final.name)
    complete = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    return path if (path / "trainer_state.pt").is_file() else None


def find_checkpoint(run_dir: str | Path, step: int | None = None) -> Path:
    """A run's checkpoint of `step` (None: the latest); the error lists the steps on disk."""
    root = Path(run_dir) / "checkpoints"
    if step is None:
        found = latest_checkpoint(run_dir)
    else:
        found = root / f"step_{step:06d}"
        found = found if (found / "trainer_state.pt").is_file() else None
    if found is None:
        steps = sorted(int(p.name.removeprefix("step_")) for p in root.glob("step_*") if p.is_dir())
        raise FileNotFoundError(
            f"{run_dir}: no complete checkpoint {'' if step is None else f'of step {step} '}(steps on disk: "
            f"{steps or 'none'}; checkpoint.keep sets how many a run keeps)"
        )
    return found


def checkpoint_step(checkpoint: str | Path) -> int:
    """The step of a checkpoint folder, from its name (step_000040 -> 40)."""
    return int(Path(checkpoint).name.removeprefix("step_"))


def load_trainer_state(checkpoint: str | Path) -> dict[str, Any]:
    # the state holds RNG tuples and numpy arrays besides tensors: our own file, so full unpickling is safe
    return torch.load(Path(checkpoint) / "trainer_state.pt", weights_only=False)
