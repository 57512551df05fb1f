"""Skipping the samples that move nothing (train.skip_zero_advantage): a batch with skipping makes the
updates of the same batch computed in full.

Each case runs `learn` twice from the same weights and optimizer, once leaving the zero-advantage samples
out of every pass and once computing them, and compares each optimizer update's gradients and metrics and
the weights after all of them. AdamW has weight decay and starts with nonzero moments, so a skipped
optimizer step, or a gradient left None (AdamW then leaves the weight alone), shows in the weights.

Tolerance (fp32): the two runs lay out different micro-batches, so matmuls sum in another order: gradients,
losses and gradient norms agree to the tiny model's bound (bounds.tiny_gradient_rtol, 1.2e-4) and the
weights to what AdamW makes of it (`_compare`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import pytest
import torch

from bounds import assert_sums_close, tiny_gradient_rtol
from conftest import tiny_config
from gspo.config import ConfigError, LoraConfig
from gspo.core.layout import LAYOUTS
from gspo.core.objectives import LossSpec
from gspo.core.registry import OBJECTIVES, SEQUENCE_OBJECTIVES
from gspo.core.samples import Sample
from gspo.learning import learner
from gspo.learning.batch import Batch, make_batch
from gspo.learning.learner import learn, minibatches
from gspo.learning.policy import Policy, UpdateSpec, skips_zero_advantage
from gspo.models import add_lora, tiny_model
from gspo.training.trainer import Trainer

REWARDS = [
    [1.0, 0.0, 0.5, 0.0],  # group 0: a spread
    [1.0, 1.0, 1.0, 1.0],  # group 1: all equal (advantage 0 for each sample)
    [0.2, 0.9, 0.9, 0.4],  # group 2: a spread
    [0.0, 0.0, 0.0, 0.0],  # group 3: all equal
]


def _samples(per_turn: bool = False) -> list[Sample]:
    """4 groups of 4 completions of their own prompt (the prompts share a 2-token start); groups 1 and 3
    have equal rewards. per_turn: 2-turn completions with per-turn rewards (per-token advantages)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for group, rewards in enumerate(REWARDS):
        prompt = [7, 8, *torch.randint(3, 60, (2 + group,), generator=g).tolist()]
        for k, reward in enumerate(rewards):
            n = 3 + (group + k) % 4
            completion = torch.randint(3, 60, (n,), generator=g).tolist()
            sample = Sample(prompt, completion, [float("nan")] * n, reward, group=group)
            if per_turn:  # turn 0, a context token, turn 1; the groups of equal rewards get no turn rewards
                sample.turns = [0] * (n - 2) + [-1, 1]
                sample.turn_rewards = [0.0 if group % 2 else 0.3 * k, 0.0]
            out.append(sample)
    return out


def _policy(kind: str = "llama", lora: bool = False) -> Policy:
    model = tiny_model(kind, vocab_size=64, seed=0)
    if lora:
        model = add_lora(model, LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"]))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
    # nonzero moments before the step: an optimizer step with a zero gradient still moves the weights
    for p in params:
        optimizer.state[p] = {
            "step": torch.tensor(3.0),
            "exp_avg": torch.full_like(p, 1e-3),
            "exp_avg_sq": torch.full_like(p, 1e-4),
        }
    return Policy(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0))


def _run(
    policy: Policy, spec: UpdateSpec, batch: Batch, monkeypatch: pytest.MonkeyPatch, seed: int = 5
) -> tuple[list[dict], list[list[torch.Tensor]], dict]:
    """learn() on ``policy``: each update's metrics and gradients, and the learn metrics and weights."""
    updates, grads = [], []
    real_update, real_step = learner.update, learner._step

    def step(p: Policy, s: UpdateSpec) -> torch.Tensor:
        norm = real_step(p, s)
        grads.append([q.grad.detach().clone() for q in p.model.parameters() if q.requires_grad])
        return norm

    monkeypatch.setattr(learner, "update", lambda *a: updates.append(real_update(*a)) or updates[-1])
    monkeypatch.setattr(learner, "_step", step)
    metrics = learn(policy, spec, batch, seed=seed)
    monkeypatch.undo()
    return (
        updates,
        grads,
        {"metrics": metrics, "params": [p.detach().clone() for p in policy.model.parameters()]},
    )


def _compare(
    make: Callable[[], Policy], spec: UpdateSpec, batch: Batch, monkeypatch: pytest.MonkeyPatch
) -> dict:
    """Skipping against computing in full on ``batch``, each on a fresh ``make()`` (the same weights and
    optimizer state); returns the skipping run's learn metrics."""
    policy = make()
    start = [p.detach().clone() for p in policy.model.parameters()]
    full = _run(policy, spec, batch, monkeypatch)
    skip = _run(make(), _skipping(spec), batch, monkeypatch)
    assert len(skip[0]) == len(full[0]) == spec.minibatches  # one optimizer step per minibatch
    rho = tiny_gradient_rtol()
    for k, (a, b) in enumerate(zip(skip[0], full[0], strict=True)):
        for key in ("loss", "grad_norm"):
            assert_sums_close(a[key], b[key], rho, msg=f"update {k}: {key}")
    for k, (a, b) in enumerate(zip(skip[1], full[1], strict=True)):
        for x, y in zip(a, b, strict=True):
            assert_sums_close(x, y, rho, msg=f"update {k}")
    moved = 0.0
    for x, y, before in zip(skip[2]["params"], full[2]["params"], start, strict=True):
        # Bound: the optimizer starts with v = 1e-4 (`_policy`), so sqrt(v_hat) >= 0.15 over these <= 4 steps
        # (betas 0.9, 0.999, bias-corrected from step 4) and AdamW is no longer scale-free: a gradient error
        # delta <= rho * 0.15 (the largest gradient here) moves m_hat by 0.29 delta and sqrt(v_hat) by 0.2
        # delta, an update by <= lr * (0.29 / 0.15 + 0.05 * 0.2 / 0.025) delta = 4.3e-7: 4 steps 1.7e-6. A
        # skipped optimizer step moves a weight by ~lr = 1e-2.
        torch.testing.assert_close(x, y, rtol=0, atol=2e-6)
        moved = max(moved, float((y - before).abs().max()))
    assert moved > 1e-3  # the updates did move the weights
    metrics = skip[2]["metrics"]
    assert full[2]["metrics"]["skipped_samples_frac"] == 0.0
    assert metrics["skipped_samples_frac"] > 0 and metrics["skipped_tokens_frac"] > 0
    assert metrics["update_tokens"] < full[2]["metrics"]["update_tokens"]  # less was computed
    return metrics


def _skipping(spec: UpdateSpec) -> UpdateSpec:
    return dataclasses.replace(spec, skip_zero_advantage=True)


def _spec(objective: str = "gspo", **fields) -> UpdateSpec:
    # wide clip ranges: the later updates are off-policy enough to clip some sequences and tokens
    knobs = {"tau_pos": 1.0} if objective.startswith("sapo") else {"eps_low": 0.01, "eps_high": 0.01}
    loss = LossSpec(objective, aggregation=fields.pop("aggregation", "seq-mean-token-mean"), **knobs)
    fields = {"minibatches": 3, "old_logprobs": "recompute", "max_new_tokens": 6, **fields}
    return UpdateSpec(loss, **fields)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_every_objective_skipping_equals_computing_in_full(objective, monkeypatch):
    batch, metrics = make_batch(_samples())
    assert metrics["zero_std_groups"] == 2.0
    assert batch.moving() == [g in (0, 2) for g in range(4) for _ in range(4)]
    got = _compare(_policy, _spec(objective), batch, monkeypatch)
    assert got["skipped_samples_frac"] == 0.5


@pytest.mark.parametrize("layout", [x for x in LAYOUTS if x != "shared_prefix"])
@pytest.mark.parametrize("objective", ["gspo", "grpo"])
def test_every_layout_skipping_equals_computing_in_full(layout, objective, monkeypatch):
    batch, _ = make_batch(_samples())
    _compare(
        _policy, _spec(objective, layout=layout, pack_length=24, micro_batch_tokens=48), batch, monkeypatch
    )


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_every_aggregation_keeps_the_whole_minibatch_s_normaliser(aggregation, monkeypatch):
    batch, _ = make_batch(_samples())
    _compare(_policy, _spec("grpo", aggregation=aggregation), batch, monkeypatch)


def test_per_turn_advantages_skip_only_samples_zero_on_every_token(monkeypatch):
    """Multi-turn samples with per-turn rewards: advantages per token; GSPO-token."""
    batch, _ = make_batch(_samples(per_turn=True))
    assert isinstance(batch.advantages, list)
    naive = [
        any(m and a != 0 for m, a in zip(s.train_mask, adv, strict=True))
        for s, adv in zip(batch.sequences, batch.advantages, strict=True)
    ]
    # groups 1 and 3: equal returns at every turn; the others' returns differ at some turn
    assert batch.moving() == naive == [g in (0, 2) for g in range(4) for _ in range(4)]
    _compare(_policy, _spec("gspo_token"), batch, monkeypatch)


def test_lora_adapters_skipping_equals_computing_in_full(monkeypatch):
    batch, _ = make_batch(_samples())
    _compare(functools.partial(_policy, lora=True), _spec("gspo"), batch, monkeypatch)


def test_moe_skipping_equals_computing_in_full(monkeypatch):
    """An expert that only the skipped samples would reach gets a zero gradient either way."""
    batch, _ = make_batch(_samples())
    _compare(functools.partial(_policy, "qwen3_moe"), _spec("gspo"), batch, monkeypatch)


def test_a_minibatch_left_with_nothing_still_takes_its_optimizer_step(monkeypatch):
    """Whole groups per minibatch, one group each: the minibatches of groups 1 and 3 compute nothing, and
    their AdamW steps (moments, weight decay) still move the weights as the full computation's do."""
    batch, _ = make_batch(_samples())
    spec = _spec("gspo", minibatch_split="group", minibatches=4)
    layout = minibatches(
        _skipping(spec),
        batch.sequences,
        seed=5,
        device=torch.device("cpu"),
        groups=batch.groups,
        computed=batch.moving(),
    )
    empty = [k for k, split in enumerate(layout) if not split.ids]
    assert len(empty) == 2 and all(layout[k].sequences == 4 for k in empty)
    assert all(not layout[k].micro for k in empty)  # no forward, no backward
    _compare(_policy, spec, batch, monkeypatch)


def test_sequence_objectives_refuse_per_token_advantages_unless_they_have_a_token_form():
    for objective in SEQUENCE_OBJECTIVES:
        spec = LossSpec(objective)
        if objective == "gspo":
            assert spec.for_token_advantages().objective == "gspo_token"
        else:
            with pytest.raises(ValueError, match="per token"):
                spec.for_token_advantages()


def test_auto_is_on_without_a_kl_term_off_with_one_and_true_with_one_is_refused(tmp_path):
    assert skips_zero_advantage(tiny_config(tmp_path / "a"))
    assert not skips_zero_advantage(tiny_config(tmp_path / "b", "train.beta=0.1"))
    assert not skips_zero_advantage(tiny_config(tmp_path / "c", "train.skip_zero_advantage=false"))
    with pytest.raises(ConfigError, match=r"train.skip_zero_advantage=true with train.beta=0.1"):
        tiny_config(tmp_path / "d", "train.beta=0.1", "train.skip_zero_advantage=true")


def test_a_run_logs_the_skipped_share_and_learns_the_same(tmp_path):
    """gspo train with skipping (the default) against the same run without: the same weights after two
    rollout batches, and the metrics say how much was left out."""
    runs = {}
    for name, value in (("skip", "auto"), ("full", "false")):
        trainer = Trainer(
            tiny_config(
                tmp_path / name,
                "eval.every=0",
                "train.steps=2",
                "rewards={number_format: 1.0, correct_number: 1.0}",  # 0/1 rewards: equal groups are common
                f"train.skip_zero_advantage={value}",
            )
        )
        history = [trainer.train_step() for _ in range(2)]
        runs[name] = (history, [p.detach().clone() for p in trainer.policy.model.parameters()])
        trainer.finish()
    (skip, skip_params), (full, full_params) = runs["skip"], runs["full"]
    assert [h["zero_std_groups"] for h in skip] == [h["zero_std_groups"] for h in full]
    assert any(h["skipped_samples_frac"] > 0 for h in skip)
    assert all(h["skipped_samples_frac"] == 0 for h in full)
    for h in skip:  # each zero-spread group is 4 skipped samples of 16 (and maybe single zeros besides)
        assert h["skipped_samples_frac"] >= h["zero_std_groups"] * 4 / 16
    # AdamW's first steps divide each gradient by its own size, so a component that is float noise in both
    # runs (a sum that cancels) may step its own way: 2 of 6336 weights of a layer differed by 5e-6 here
    off = [(x - y).abs() for x, y in zip(skip_params, full_params, strict=True)]
    assert max(float(d.max()) for d in off) < 1e-4
    assert sum(int((d > 1e-6).sum()) for d in off) < 1e-3 * sum(d.numel() for d in off)
