"""Session-wide test setup that must happen before any test module imports triton."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Triton's kernels (gspo.core.triton_logprobs) run interpreted on a CPU. Triton reads this when it is
    # first imported, and torch or transformers import it early: so here, before any test module.
    os.environ.setdefault("TRITON_INTERPRET", "1")
