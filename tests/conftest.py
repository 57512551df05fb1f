"""Session-wide test setup that must happen before any test module imports triton, and shared fixtures."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

if not torch.cuda.is_available():
    # Triton's kernels (gspo.core.triton_logprobs) run interpreted on a CPU. Triton reads this when it is
    # first imported, and torch or transformers import it early: so here, before any test module.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def rollout_logprobs() -> Callable[..., list[torch.Tensor]]:
    """The trainer's fp32 log-probs of each rollout's completion tokens (padded layout, no grad): the
    reference a sampler's reported log-probs are compared with."""
    from gspo.core.layout import Sequence, make_micro_batches
    from gspo.core.logprobs import causal_lm_logprobs

    def score(model: torch.nn.Module, rollouts) -> list[torch.Tensor]:
        sequences = [
            Sequence(p, c, [True] * len(c))
            for p, c in zip(rollouts.prompt_ids, rollouts.completion_ids, strict=True)
        ]
        (mb,) = make_micro_batches(
            sequences, layout="padded", pack_length=1024, micro_batch_tokens=10_000, pad_id=0
        )
        with torch.no_grad():
            logp = causal_lm_logprobs(
                model,
                mb.input_ids,
                attention_mask=mb.attention_mask,
                position_ids=mb.position_ids,
                logprob_mask=mb.logprob_mask,
            )
        out = [torch.empty(0)] * len(mb.indices)
        for row, i in enumerate(mb.indices):
            out[i] = logp[row][mb.logprob_mask[row]]
        return out

    return score


@pytest.fixture(scope="session")
def two_step_run(tmp_path_factory: pytest.TempPathFactory):
    """configs/tiny.yaml trained for 2 steps with every checkpoint kept (steps 0, 1 and 2) and no
    evaluations in between; tests that change it work on a copy (`shutil.copytree`)."""
    from pathlib import Path

    from gspo.config import load_config
    from gspo.training.trainer import train

    run = tmp_path_factory.mktemp("two_step") / "run"
    tiny = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
    overrides = ["train.steps=2", "checkpoint.keep=3", "eval.every=0", "tensorboard=false", "task.num_eval=4"]
    train(load_config(tiny, [f"output_dir={run}", *overrides]))
    return run
