"""`gspo export`: a run's checkpoint as a Hugging Face directory (LoRA merged) or a GGUF file for llama.cpp.

The GGUF carries the metadata and tokenizer of the GGUF the run started from, when it started from one
(the embedded SmolLM2 does), else they are built from the HF config and tokenizer (gspo.models.gguf_export).

An export reads the checkpoint and takes no lock: a checkpoint never changes once written, and a run
being trained never writes into RUN_DIR/export. It writes beside its target and renames it into place,
never over an existing file or folder without `force`, and never inside a checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from gspo.config import load_config
from gspo.files import replacing_folder, run_path
from gspo.models import ModelError, save_model
from gspo.models.gguf_export import write_gguf
from gspo.run.build import load_checkpoint_policy, source_gguf
from gspo.run.checkpoint import CONFIG_FILE, check_output, checkpoint_step, find_checkpoint
from gspo.run.trust import check_reaches, model_reaches


def export_run(
    run_dir: str | Path,
    *,
    format: Literal["hf", "gguf"],
    quant: str = "f16",
    step: int | None = None,
    output: str | Path | None = None,
    force: bool = False,
    overrides: Sequence[str] = (),
    trust_run_folder: bool = False,
) -> Path:
    """Write the run's checkpoint of `step` (None: the latest) and return the path written.

    output: default RUN_DIR/export/step_000040-hf/ or RUN_DIR/export/step_000040-f16.gguf. An existing
    output is written over only with `force` (a folder: the exported files replace theirs, others stay).
    The model file the run's config names beside the checkpoint (a LoRA run's base, a GGUF whose metadata
    the export copies) is read only when `overrides` name it (``model.path=...``), the user started the run
    with it, or with `trust_run_folder` (gspo.run.trust).
    """
    if format not in ("hf", "gguf"):
        raise ValueError(f"format={format!r}: choose 'hf' or 'gguf'")
    checkpoint = find_checkpoint(run_dir, step)
    name = f"step_{checkpoint_step(checkpoint):06d}"
    default = f"{name}-hf" if format == "hf" else f"{name}-{quant}.gguf"
    path = Path(output) if output else run_path(run_dir, "export", default)
    check_output(path, force=force)  # before the model is loaded: refused at once
    own = checkpoint / CONFIG_FILE  # the model and LoRA settings it was trained with
    config = load_config(own if own.is_file() else run_path(run_dir, "config.yaml"), overrides)
    reads = model_reaches(config, copies_gguf=format == "gguf")
    check_reaches(config, overrides, folder=Path(run_dir), trust_run_folder=trust_run_folder, keys=reads)
    model, tokenizer = load_checkpoint_policy(config, checkpoint)
    if format == "hf":
        return _save_folder(model, tokenizer, path)
    try:
        return write_gguf(model, tokenizer, path, quant=quant, source=source_gguf(config.model))
    except NotImplementedError as error:  # an architecture or tokenizer the GGUF writer does not know
        raise ModelError(str(error)) from error


def _save_folder(model: object, tokenizer: object, path: Path) -> Path:
    """save_pretrained into a fresh folder, renamed into place, or into an existing folder (force) file by
    file: each file replaces its namesake (gspo.files.replacing_folder)."""
    run_path(path.parent, f".{path.name}.tmp")  # not through a link planted there
    with replacing_folder(path) as tmp:
        save_model(model, tokenizer, tmp)
    return path
