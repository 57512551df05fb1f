"""Weight sync for a llama.cpp server (gspo.rollout.llama_cpp.GGUFReload): after a training step the server
serves the trainer's updated weights (skipped, with the reason, where llama-cpp-python is missing)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gspo.config import load_config
from gspo.models.gguf_export import write_gguf
from gspo.rollout.llama_cpp import GGUFReload, LlamaCppServer
from gspo.rollout.openai import OpenAIBackend

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.llama_cpp  # skipped without llama-cpp-python (conftest.py)


def _gap(model_logprobs: list[torch.Tensor], rollouts) -> float:
    """Largest |log p_server - log p_model| over the tokens the server reported."""
    gaps = []
    for mine, theirs in zip(model_logprobs, rollouts.sampler_logprobs, strict=True):
        theirs = torch.tensor(theirs)
        known = torch.isfinite(theirs)
        gaps.append((mine[known] - theirs[known]).abs().max())
    return float(torch.stack(gaps).max())


def test_gguf_reload_makes_the_server_sample_from_the_updated_policy(
    tmp_path: Path, rollout_logprobs
) -> None:
    from gspo.training.trainer import Trainer

    config = load_config(
        ROOT / "configs" / "tiny.yaml",
        [f"output_dir={tmp_path / 'run'}", "report_to=[]", "train.lr=0.01", "eval.every=0"],
    )
    trainer = Trainer(config)
    model, tokenizer = trainer.policy.model, trainer.tokenizer
    first = write_gguf(model, tokenizer, tmp_path / "initial.gguf", quant="f32")
    with LlamaCppServer(first, n_ctx=512) as server:
        sync = GGUFReload(server, tmp_path / "sync", quant="f32")
        # the random tiny model now and then samples a control token, which a text server cannot report
        trainer.rollouts.side.sampler = OpenAIBackend(
            server.url, tokenizer, weight_sync=sync, misaligned="resample", timeout=60
        )
        before = {k: v.clone() for k, v in model.state_dict().items()}
        prompts = trainer.rollouts.prompts(trainer.eval_examples[:2])
        rollouts = trainer.sampler.generate(prompts, group_size=2, max_new_tokens=6, seed=0)
        assert _gap(rollout_logprobs(model, rollouts), rollouts) < 1e-3  # f32 GGUF: the same weights
        trainer.train_step()  # samples from the server, updates, then syncs
        assert server.restarts == 1 and len(sync.seconds) == 1
        rollouts = trainer.sampler.generate(prompts, group_size=2, max_new_tokens=6, seed=1)
        assert (
            _gap(rollout_logprobs(model, rollouts), rollouts) < 1e-3
        )  # the server serves the updated weights
        initial = type(model)(model.config)
        initial.load_state_dict(before)
        assert (
            _gap(rollout_logprobs(initial.eval(), rollouts), rollouts) > 1e-2
        )  # ... which are not the initial ones
    trainer.logger.close()


def test_gspo_train_with_the_llama_cpp_engine_syncs_every_n_steps(tmp_path: Path) -> None:
    """rollout.engine=llama_cpp: the server starts on the exported policy and restarts every sync_every steps;
    the sampler-vs-trainer log-prob gap is ~0 right after a sync and grows on the step that samples stale weights."""
    from gspo.run.metrics import read_metrics
    from gspo.training.trainer import Trainer

    config = load_config(
        ROOT / "configs" / "tiny.yaml",
        [
            f"output_dir={tmp_path / 'run'}",
            "report_to=[]",
            "train.lr=0.01",
            "eval.every=0",
            "train.steps=3",
            "rollout.engine=llama_cpp",
            "rollout.llama_cpp.sync_every=2",
            "rollout.llama_cpp.gguf_quant=f32",
            "checkpoint.every=0",
        ],
    )
    trainer = Trainer(config)
    sync = trainer.sampler.weight_sync
    try:
        trainer.run()
        assert len(sync.seconds) == 1 and sync.server.restarts == 1  # after step 2 only
    finally:
        sync.server.close()
    gap = {
        r["step"]: r["sampler_logprob_abs_diff"]
        for r in read_metrics(tmp_path / "run")
        if r["kind"] == "train"
    }
    assert gap[1] < 1e-3 and gap[3] < 1e-3  # sampled from the current weights (initial; synced after step 2)
    assert gap[2] > 10 * max(gap[1], gap[3])  # sampled from weights one update old
    assert (tmp_path / "run" / "llama_cpp" / "policy.gguf").is_file()
