"""The CUDA paths on a GPU: device placement, bf16 autocast, chunked log-probs, `gspo train`, FSDP2 on one rank.

Marked ``cuda`` and skipped without a GPU (CI has none): `pytest -m cuda` runs them on a GPU machine
(docs/gpu.md). ``GSPO_CUDA_TESTS_DEVICE=cpu`` runs them on the CPU instead (gloo, Triton interpreted), to
check the tests' own logic without a GPU (tests/conftest.py sets TRITON_INTERPRET=1 on a machine
without CUDA); the assertions about CUDA itself are then skipped.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from gspo.core.layout import TokenSequence
from gspo.core.logprobs import token_logprobs
from gspo.core.seeds import step_seed
from gspo.learning.batch import Batch
from gspo.learning.learner import learn
from gspo.models.loading import tiny_model
from gspo.parallel import group, wrap

ON_CPU = os.environ.get("GSPO_CUDA_TESTS_DEVICE") == "cpu"
DEVICE = torch.device("cpu" if ON_CPU else "cuda", None if ON_CPU else 0)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not (ON_CPU or torch.cuda.is_available()), reason="needs a CUDA GPU (docs/gpu.md)"),
]


ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
HAS_TRITON = importlib.util.find_spec("triton") is not None
KERNELS = ["torch", "triton"] if HAS_TRITON else ["torch"]


def test_device_placement_puts_everything_on_the_gpu(tmp_path: Path) -> None:
    from gspo.training.trainer import Trainer

    if not ON_CPU:
        assert group.resolve_device("auto") == torch.device("cuda", 0)
        assert group.resolve_device("cuda") == torch.device("cuda", 0)
        assert wrap.compute_dtype("auto", DEVICE) is torch.bfloat16  # bf16 by default on a GPU
    trainer = Trainer(
        tiny_config(
            tmp_path / "run", f"device={DEVICE.type}", "train.steps=1", "eval.every=0", "checkpoint.every=0"
        )
    )
    trainer.train_step()
    assert trainer.device.type == DEVICE.type
    assert all(p.device.type == DEVICE.type for p in trainer.policy.model.parameters())
    assert all(p.dtype == torch.float32 for p in trainer.policy.model.parameters())  # fp32 master weights
    state = [v for s in trainer.policy.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    assert state and all(v.device.type == DEVICE.type for v in state if v.dim() > 0)


def _inputs(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2, 40), generator=gen).to(DEVICE)
    positions = torch.cat([torch.arange(15), torch.arange(25)]).repeat(2, 1).to(DEVICE)  # packed rows
    return ids, positions


@pytest.mark.parametrize("kernel", KERNELS)
def test_bf16_autocast_log_probs_are_close_to_fp32(kernel: str) -> None:
    """bf16 compute in the decoder, fp32 in the head: on a tiny random model the log-probs stay within
    0.05 (max) and 0.01 (mean) of the fp32 ones, and the gradient keeps its direction (cosine > 0.99).
    The head itself computes in fp32 under autocast: the same hidden states give bit-equal log-probs."""
    vocab = 512
    model = tiny_model("llama", vocab_size=vocab, seed=0).to(DEVICE)
    ids, positions = _inputs(vocab)
    results = []
    for dtype in (None, torch.bfloat16):
        model.zero_grad(set_to_none=True)
        scorer = wrap.LogprobScorer(model, dtype)
        logp = scorer(ids, position_ids=positions, chunk_size=16, kernel=kernel)
        (logp * torch.linspace(-1, 1, logp.numel(), device=DEVICE).view_as(logp)).sum().backward()
        grad = torch.cat([p.grad.flatten() for p in model.parameters()])
        results.append((logp.detach(), grad))
    (exact, g32), (mixed, g16) = results
    scored = exact != 0
    diff = (exact - mixed)[scored].abs()
    assert diff.max() < 0.05 and diff.mean() < 0.01, (diff.max(), diff.mean())
    assert torch.nn.functional.cosine_similarity(g32, g16, dim=0) > 0.99

    hidden = torch.randn(64, 64, device=DEVICE)
    targets = torch.randint(0, vocab, (64,), device=DEVICE)
    weight = model.get_output_embeddings().weight.detach()
    plain = token_logprobs(hidden, weight, targets, chunk_size=16, kernel=kernel)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        autocast = token_logprobs(hidden, weight, targets, chunk_size=16, kernel=kernel)
    # exact by design: token_logprobs turns autocast off, so the same fp32 kernels run on the same inputs
    torch.testing.assert_close(autocast, plain, atol=0, rtol=0)


@pytest.mark.parametrize("kernel", KERNELS)
def test_chunked_log_probs_equal_the_naive_path_on_the_gpu(kernel: str) -> None:
    """fp32 values and gradients against float64 full logits, at a size with several chunks and a
    vocabulary that is no power of two; and the chunked peak memory below the naive path's."""
    n, h, v, chunk = 3000, 128, 20011, 1024
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(n, h, generator=gen).to(DEVICE).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) * 0.2).to(DEVICE).requires_grad_()
    bias = torch.randn(v, generator=gen).to(DEVICE).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen).to(DEVICE)
    upstream = torch.randn(n, generator=gen).to(DEVICE)
    assert not torch.backends.cuda.matmul.allow_tf32  # fp32 GEMMs stay fp32 (torch's default)

    def naive():
        logits = (hidden.double() @ weight.double().T + bias.double()) / 0.8
        return torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)

    def peak(fn):
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        out = fn()
        grads = torch.autograd.grad((out * upstream.to(out.dtype)).sum(), (hidden, weight, bias))
        used = torch.cuda.max_memory_allocated() - base if DEVICE.type == "cuda" else 0
        return out, grads, used

    logp, grads, used = peak(
        lambda: token_logprobs(
            hidden, weight, targets, chunk_size=chunk, temperature=0.8, lm_head_bias=bias, kernel=kernel
        )
    )
    ref, ref_grads, ref_used = peak(naive)
    # fp32 against float64, ~sqrt(n)*u times the terms' summed size per sum (u = 2^-24, independent rounding):
    # a logit ~sqrt(128)*u*sum|h_i w_i|/T <= ~3e-5, log pi twice that plus the 20011-term log-sum-exp's ~1e-5;
    # a gradient entry ~sqrt(20011)*u*sum_j pi_j |s w_j| (<= 3) <= ~3e-5, the tokens' few large terms less
    torch.testing.assert_close(logp.double(), ref, atol=1e-4, rtol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)
    if DEVICE.type == "cuda":
        assert used < ref_used / 4, (used, ref_used)


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        [sys.executable, "-m", "gspo", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def test_gspo_train_runs_end_to_end_on_the_gpu(tmp_path: Path) -> None:
    result = _cli(
        "train", str(TINY), "output_dir=run", f"device={DEVICE.type}", "train.steps=2", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in train)
    resolved = (tmp_path / "run" / "config.yaml").read_text()
    assert f"device: {DEVICE.type}" in resolved


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch() -> Batch:
    """Four groups of three sequences sharing a prompt, random tokens, fixed advantages."""
    g = torch.Generator().manual_seed(3)
    sequences, groups = [], []
    for owner in range(4):
        prompt = torch.randint(3, 90, (5,), generator=g).tolist()
        for _ in range(3):
            completion = torch.randint(3, 90, (int(torch.randint(3, 12, (), generator=g)),), generator=g)
            sequences.append(TokenSequence(prompt, completion.tolist(), [True] * len(completion)))
            groups.append(owner)
    advantages = torch.randn(len(sequences), generator=g)
    return Batch(sequences, advantages, [[-4.0] * len(s.completion_ids) for s in sequences], groups)


def test_fsdp2_on_one_gpu_rank_makes_the_one_process_updates(tmp_path: Path, monkeypatch) -> None:
    """FSDP2 (fully_shard on each decoder layer and the root) on a one-rank NCCL group: two rollout
    batches of updates give the parameters of the plain one-process run (fp32; tolerance for the
    order of floating-point sums, which FSDP2's flat gradient buffers may change)."""
    import torch.distributed as dist

    from gspo.training.trainer import Trainer

    overrides = [
        "eval.every=0",
        "checkpoint.every=0",
        "train.mixed_precision=none",
        "train.old_logprobs=recompute",
    ]
    results = {}
    backend = "gloo" if ON_CPU else "nccl"
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{_free_port()}",
        rank=0,
        world_size=1,
        timeout=timedelta(minutes=2),
    )
    try:
        for wrapper in ("plain", "fsdp2"):
            with monkeypatch.context() as patch:
                if wrapper == "fsdp2":  # wrap_model keeps a one-process model plain: force the FSDP2 branch
                    patch.setattr(wrap, "world_size", lambda: 2)
                trainer = Trainer(
                    tiny_config(
                        tmp_path / wrapper, f"device={DEVICE.type}", "distributed.wrapper=fsdp2", *overrides
                    )
                )
            assert wrap.is_fsdp(trainer.policy.scorer) == (wrapper == "fsdp2")
            if wrapper == "plain":
                initial = {
                    k: v.detach().float().cpu().clone() for k, v in trainer.policy.model.state_dict().items()
                }
            for step in range(2):
                trainer.step = step
                learn(
                    trainer.policy, trainer.spec, _batch(), seed=step_seed(trainer.config.seed, trainer.step)
                )
            state = trainer.policy.model.state_dict()
            results[wrapper] = {
                k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().cpu()
                for k, v in state.items()
            }
    finally:
        dist.destroy_process_group()
    plain, sharded = results["plain"], results["fsdp2"]
    assert plain.keys() == sharded.keys()
    assert any(not torch.equal(plain[k], initial[k]) for k in plain), "the updates moved no parameter"
    for k in plain:
        torch.testing.assert_close(sharded[k], plain[k], atol=1e-5, rtol=1e-4, msg=k)
