"""`gspo export`: a run's checkpoint as a Hugging Face directory (LoRA merged) or a GGUF file for llama.cpp.

The GGUF carries the metadata and tokenizer of the GGUF the run started from, when it started from one
(the embedded SmolLM2 does), else they are built from the HF config and tokenizer (gspo.models.gguf_export).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from gspo.config import load_config
from gspo.models import save_model
from gspo.models.gguf_export import write_gguf
from gspo.training.build import load_checkpoint_policy, source_gguf
from gspo.training.checkpoint import checkpoint_step, find_checkpoint


def export_run(
    run_dir: str | Path,
    *,
    format: Literal["hf", "gguf"],
    quant: str = "f16",
    step: int | None = None,
    output: str | Path | None = None,
) -> Path:
    """Write the run's checkpoint of `step` (None: the latest) and return the path written.

    output: default RUN_DIR/export/step_000040-hf/ or RUN_DIR/export/step_000040-f16.gguf.
    """
    if format not in ("hf", "gguf"):
        raise ValueError(f"format={format!r}: choose 'hf' or 'gguf'")
    config = load_config(Path(run_dir) / "config.yaml")
    checkpoint = find_checkpoint(run_dir, step)
    model, tokenizer = load_checkpoint_policy(config, checkpoint)
    name = f"step_{checkpoint_step(checkpoint):06d}"
    if format == "hf":
        path = Path(output or Path(run_dir) / "export" / f"{name}-hf")
        save_model(model, tokenizer, path)
        return path
    path = Path(output or Path(run_dir) / "export" / f"{name}-{quant}.gguf")
    return write_gguf(model, tokenizer, path, quant=quant, source=source_gguf(config.model))
