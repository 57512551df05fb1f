"""Sequence data parallelism on CPU/gloo: rows split across 2 and 4 ranks make the one-process numbers.

Starting processes is most of the cost, so one spawn of 4 workers runs every scenario on one process group
and saves what it saw; the tests compare that with one-process references computed here. Groups of 2 are
2 sequence-parallel x 2 data-parallel ranks; a group of 4 splits every row four ways. Tolerance: float
summation order is the only difference, so log-probs and gradients agree to the tiny model's bound
(bounds.tiny_gradient_rtol) and weights to AdamW's amplification of it (bounds.assert_adam_close).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from bounds import assert_adam_close, assert_sums_close, sum_rtol, tiny_gradient_rtol
from conftest import tiny_config
from gloo_ranks import result, run_ranks
from gspo.config import ConfigError, validate_setup
from gspo.core.layout import MicroBatch, TokenSequence, make_micro_batches
from gspo.core.seeds import step_seed
from gspo.learning.batch import Batch
from gspo.learning.learner import learn

WORLD = 4
DEADLINE_S = 240
RHO = tiny_gradient_rtol()  # log-probs and gradients: sums in another order (bounds.py)


# ---- log-probs and gradients of a split row ---------------------------------------------------------
def _rows() -> MicroBatch:
    """Two packed rows 48 wide (slice edges at 12, 24, 36): [36-token sequence | 12], its completion
    crossing edges 12 and 24 mid-way; and [24 | 12 | 8 | padding], segments ending exactly on edges 24
    and 36 (the 2- and 4-way edges)."""
    g = torch.Generator().manual_seed(5)
    shapes = [(5, 19), (3, 9), (2, 10), (6, 30), (4, 4)]  # (prompt, completion) tokens
    sequences = []
    for prompt, completion in shapes:
        ids = torch.randint(3, 90, (prompt + completion,), generator=g).tolist()
        sequences.append(TokenSequence(ids[:prompt], ids[prompt:], [True] * completion))
    (mb,) = make_micro_batches(sequences, layout="packed", pack_length=48, micro_batch_tokens=1024, pad_id=0)
    assert mb.input_ids.shape == (2, 48)
    return mb


def _model(family: str) -> torch.nn.Module:
    from gspo.models.loading import tiny_model

    if family != "qwen2_window":
        return tiny_model(family, 96, seed=0)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(  # GQA; layer 0 full attention, layer 1 a 7-token sliding window
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=7,
        max_window_layers=1,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(config)


def _weights(shape: torch.Size) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(11))


def _logprobs_and_grads(model, mb: MicroBatch, split=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """log-probs (B, T) and the gradients of sum(w * logp); one process (split None) or this rank's slice."""
    from gspo.core.row_slices import lm_logprobs

    model.zero_grad(set_to_none=True)
    extra = {} if split is None else {"split": split}
    logp = lm_logprobs(
        model, mb.input_ids, position_ids=mb.position_ids, logprob_mask=mb.logprob_mask, **extra
    )
    (logp * _weights(logp.shape)).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


FAMILIES = ("llama", "qwen3_moe", "qwen2_window")


def _scenario_logprobs(rank: int, out: Path) -> dict[str, Any]:
    from gspo.parallel.sequence import sequence_group

    results = {}
    for size in (2, 4):
        group = sequence_group(size)
        for family in FAMILIES:
            results[(size, family)] = _logprobs_and_grads(_model(family), _rows(), group.split)
    return results


# ---- learn() with the trainer's wiring --------------------------------------------------------------
LEARN = {  # name: (sequence_parallel, wrapper, objective, model)
    "gspo_2x2_ddp": (2, "ddp", "gspo", "llama"),
    "gspo_token_4_fsdp2": (4, "fsdp2", "gspo_token", "llama"),
    "gspo_2x2_ddp_moe": (2, "ddp", "gspo", "qwen3_moe"),
}
SEQUENCES_PER_RANK = 4


def _learn_config(run_dir: Path, name: str, sequence_parallel: int):
    _, wrapper, objective, family = LEARN[name]
    return tiny_config(
        run_dir,
        "eval.every=0",
        f"model.tiny={family}",
        f"distributed.wrapper={wrapper}",
        f"distributed.sequence_parallel={sequence_parallel}",
        f"train.objective={objective}",
        "train.layout=packed",
        "train.pack_length=40",
        "train.micro_batch_tokens=80",
        "train.minibatches=2",
        "train.old_logprobs=recompute",
        "train.mixed_precision=none",
    )


def _learn_batch() -> Batch:
    """16 sequences of 14-36 tokens in 8 groups, mostly completion: rows cut across sequences everywhere."""
    g = torch.Generator().manual_seed(3)
    sequences = []
    for _ in range(WORLD * SEQUENCES_PER_RANK):
        prompt = torch.randint(3, 90, (int(torch.randint(2, 7, (), generator=g)),), generator=g).tolist()
        completion = torch.randint(
            3, 90, (int(torch.randint(12, 30, (), generator=g)),), generator=g
        ).tolist()
        mask = [True] * len(completion)
        mask[-1] = False  # an untrained token (a truncation mask)
        sequences.append(TokenSequence(prompt, completion, mask))
    advantages = torch.randn(len(sequences), generator=g)
    sampler = [[-4.0] * len(s.completion_ids) for s in sequences]
    return Batch(sequences, advantages, sampler, [i // 2 for i in range(len(sequences))])


def _rank_share(batch: Batch, rank: int) -> Batch:
    mine = slice(rank * SEQUENCES_PER_RANK, (rank + 1) * SEQUENCES_PER_RANK)
    return Batch(
        batch.sequences[mine], batch.advantages[mine], batch.sampler_logprobs[mine], batch.groups[mine]
    )


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()  # FSDP2: gathered


def _learn(trainer, batch: Batch) -> dict[str, Any]:
    """The metrics of learn() (two optimizer updates), the parameters after them, and the gradients of the
    second update (computed at the parameters the first one left)."""
    metrics = learn(trainer.policy, trainer.spec, batch, seed=step_seed(trainer.config.seed, 0))
    model = trainer.policy.model
    return {
        "metrics": metrics,
        "params": {k: _full(v) for k, v in model.state_dict().items()},
        "grads": {k: _full(p.grad) for k, p in model.named_parameters()},
    }


def _scenario_learn(rank: int, out: Path, name: str) -> dict[str, Any]:
    from gspo.training.trainer import Trainer

    trainer = Trainer(_learn_config(out / name, name, LEARN[name][0]))
    return _learn(trainer, _rank_share(_learn_batch(), rank))


# ---- the workers ------------------------------------------------------------------------------------
SCENARIOS = {"logprobs": _scenario_logprobs} | {
    name: (lambda rank, out, name=name: _scenario_learn(rank, out, name)) for name in LEARN
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(__name__, WORLD, tmp_path_factory.mktemp("sequence_parallel"), DEADLINE_S)


# ---- the tests --------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_split_rows_give_the_one_process_logprobs_and_gradients(runs, family, size):
    """Each group's ranks together: every token's log-prob once (its owner's), and gradients summing to
    one process's, for GQA models (Llama, Qwen3-MoE) and a sliding window (Qwen2)."""
    per_rank = [r[(size, family)] for r in result(runs, "logprobs")]
    mb = _rows()
    want_logp, want_grads = _logprobs_and_grads(_model(family), mb)
    assert bool((want_logp[mb.logprob_mask] != 0).all())
    for group in range(WORLD // size):
        ranks = per_rank[group * size : (group + 1) * size]
        # a token is scored by one rank only: the others hold exactly 0 there
        assert all(
            bool(((a != 0) & (b != 0)).sum() == 0)
            for a in [r[0] for r in ranks]
            for b in [r[0] for r in ranks]
            if a is not b
        )
        assert_sums_close(sum(r[0] for r in ranks), want_logp, RHO)
        assert set(ranks[0][1]) == set(want_grads)
        for key, want in want_grads.items():
            assert_sums_close(sum(r[1][key] for r in ranks), want, RHO, msg=key)


# metrics of an update that do not depend on how a minibatch is cut into micro-batches or rows
LAYOUT_FREE = ("loss", "grad_norm", "num_sequences", "num_seq_nonzero_adv", "num_tokens")
LAYOUT_FREE += ("ratio_token_min", "ratio_token_max", "ratio_seq_min", "ratio_seq_max")
LR = 1e-3  # conftest.TINY_NUMERICS


@pytest.mark.parametrize("name", list(LEARN))
def test_sequence_parallel_learn_makes_the_one_process_updates(runs, tmp_path, name):
    """learn() on 4 ranks, each holding 4 of the 16 sequences (rollouts unchanged), rows split across each
    group: the loss, the metrics, the gradients of the second update and the parameters after both are one
    process's."""
    from gspo.training.trainer import Trainer

    ranks = result(runs, name)
    want = _learn(Trainer(_learn_config(tmp_path, name, 1)), _learn_batch())
    assert want["metrics"]["clip_frac_token_high" if "token" in name else "clip_frac_seq_high"] > 0
    for got in ranks:
        assert set(got["params"]) == set(want["params"])
        for key in LAYOUT_FREE:
            assert_sums_close(got["metrics"][key], want["metrics"][key], RHO, msg=key)
        for key, value in want["grads"].items():
            assert_sums_close(got["grads"][key], value, RHO, msg=key)
        for key, value in want["params"].items():
            assert_adam_close(got["params"][key], value, lr=LR, updates=2, rho=RHO, msg=key)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.layout=shared_prefix"], r"splits packed rows: set train\.layout=packed \(or auto\)"),
        (["train.objective=gmpo"], r"does not support train\.objective=gmpo.*use gspo or gspo_token"),
        (
            ["train.sampler_correction=sequence_truncate"],
            r"set them off, or set distributed\.sequence_parallel=1",
        ),
        (["distributed.sequence_parallel=0"], r"distributed\.sequence_parallel"),
    ],
)
def test_settings_a_split_row_cannot_train_name_the_fix(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(tmp_path, "distributed.sequence_parallel=2", *overrides)


def test_a_group_size_that_does_not_divide_the_processes_names_the_fix(tmp_path):
    config = tiny_config(tmp_path, "distributed.sequence_parallel=4", "rollout.prompts_per_step=12")
    with pytest.raises(
        ConfigError, match=r"sequence_parallel=4 does not divide the 6 processes: launch a multiple"
    ):
        validate_setup(config, num_processes=6, is_moe=False)
    validate_setup(config, num_processes=4, is_moe=False)  # one group of 4


@pytest.mark.parametrize(
    ("path", "window"),
    [("lse", None), ("blocks", 5), ("causal-bias", None)],
    ids=["lse", "blocks", "causal-bias"],
)
def test_a_continuing_piece_attends_to_its_segment_s_earlier_keys(monkeypatch, path, window):
    """Queries 13..32 of a segment against its keys 0..32 (GQA) equal sdpa with the dense mask, values and
    gradients: on CPU the flash kernel's parts (prefix blocks of 5, 5 and 3 keys, then the queries' own)
    merged by log-sum-exp; with a sliding window masked, checkpointed blocks (3 of 8 queries); torch's
    lower-right CausalBias (the CUDA path, run on CPU)."""
    from gspo.core import row_slices as sequence_parallel

    monkeypatch.setattr(sequence_parallel, "QUERY_BLOCK", 8)
    if path == "causal-bias":
        monkeypatch.setattr(sequence_parallel, "LOWER_RIGHT_DEVICES", ("cpu",))
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, h, n, 8, generator=g, requires_grad=True) for h, n in ((4, 20), (2, 33), (2, 33))
    )
    distance = torch.arange(20)[:, None] + 13 - torch.arange(33)[None, :]
    mask = (distance >= 0) & (distance < (window or 10**9))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    upstream = torch.randn(want.shape, generator=g)
    if path == "lse":  # the forward and backward that _GatheredAttention calls on CPU
        with torch.no_grad():
            got, lse = sequence_parallel._prefix_then_causal(q, k, v, 13, None, block=5)
            got_grads = sequence_parallel._prefix_then_causal_backward(
                upstream, q, k, v, got, lse, 13, None, block=5
            )
    else:
        got = sequence_parallel._attend(q, k, v, 13, sequence_parallel._Attend(None, True, window))
        got_grads = torch.autograd.grad((got * upstream).sum(), (q, k, v))
    grads = [got_grads, torch.autograd.grad((want * upstream).sum(), (q, k, v))]
    # attention over at most 33 keys of 8 dimensions, merged by log-sum-exp: sums of <= 64 terms (bounds.py)
    assert_sums_close(got, want, 4 * sum_rtol(64))
    for a, b in zip(*grads, strict=True):
        assert_sums_close(a, b, 4 * sum_rtol(64))
