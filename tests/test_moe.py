"""MoE routing: recording, volatility against a hand count, Routing Replay, trainer wiring, the experiment."""

from __future__ import annotations

import contextlib
import itertools
import json
from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from gspo.config import ConfigError
from gspo.core.layout import MicroBatch, TokenSequence, make_micro_batches
from gspo.core.logprobs import causal_lm_logprobs
from gspo.learning import learner
from gspo.models import moe, tiny_model
from gspo.run.metrics import read_metrics
from gspo.training.trainer import Trainer


def _model(norm_topk_prob: bool = False) -> torch.nn.Module:
    model = tiny_model("qwen3_moe", 99, seed=0).eval()  # 2 MoE layers, 8 experts, top-2
    for router in moe.moe_routers(model):
        router.norm_topk_prob = norm_topk_prob
    return model


def _packed() -> list[MicroBatch]:
    """Two packed micro-batches of sequences with varied prompt and completion lengths."""
    g = torch.Generator().manual_seed(0)
    sequences = []
    for n_prompt, n_completion in [(9, 5), (14, 3), (6, 8), (11, 4), (7, 6), (12, 2)]:
        ids = torch.randint(3, 99, (n_prompt + n_completion,), generator=g).tolist()
        sequences.append(TokenSequence(ids[:n_prompt], ids[n_prompt:], [True] * n_completion))
    micro = make_micro_batches(sequences, layout="packed", pack_length=32, micro_batch_tokens=64, pad_id=0)
    assert len(micro) == 2 and all(mb.attention_mask is None for mb in micro)
    return micro


def _logprobs(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    return causal_lm_logprobs(
        model,
        mb.input_ids,
        attention_mask=mb.attention_mask,
        position_ids=mb.position_ids,
        logprob_mask=mb.logprob_mask,
    )


def _router_inputs(model: torch.nn.Module, mb: MicroBatch) -> list[torch.Tensor]:
    """The hidden states (N, H) each router receives, captured by the test's own hooks."""
    inputs: list[torch.Tensor] = []
    handles = [
        r.register_forward_pre_hook(
            lambda m, args: inputs.append(args[0].detach().reshape(-1, args[0].shape[-1]))
        )
        for r in moe.moe_routers(model)
    ]
    with torch.no_grad():
        _logprobs(model, mb)
    for h in handles:
        h.remove()
    return inputs


def test_volatility_is_zero_when_weights_did_not_change() -> None:
    model, micro = _model(), _packed()
    before = [moe.expert_choices(model, mb) for mb in micro]
    assert moe.routing_volatility(model, micro, before) == {
        "routing_volatility": 0.0,
        "routing_expert_change_frac": 0.0,
    }


def test_volatility_matches_a_hand_count_after_perturbing_a_router() -> None:
    model, micro = _model(), _packed()
    before = [moe.expert_choices(model, mb) for mb in micro]
    routers = moe.moe_routers(model)
    old_weight = routers[-1].weight.detach().clone()
    # only the last layer's router moves, so its inputs (and every earlier choice) stay as they were
    with torch.no_grad():
        routers[-1].weight.add_(
            0.05 * torch.randn(old_weight.shape, generator=torch.Generator().manual_seed(1))
        )
    new_weight = routers[-1].weight.detach()

    changed_sets = changed_experts = pairs = 0
    for mb, recorded in zip(micro, before, strict=True):
        hidden = _router_inputs(model, mb)[-1]  # (N, H) input of the last router
        completion = mb.logprob_mask.reshape(-1).tolist()
        for n, counted in enumerate(completion):
            if not counted:
                continue
            old_logits = [float(x) for x in hidden[n] @ old_weight.T]
            new_logits = [float(x) for x in hidden[n] @ new_weight.T]
            old_set = set(sorted(range(8), key=lambda e: -old_logits[e])[:2])  # softmax keeps the order
            new_set = set(sorted(range(8), key=lambda e: -new_logits[e])[:2])
            assert old_set == set(recorded.experts[-1][n].tolist())  # the recording is the true top-2
            changed_sets += old_set != new_set
            changed_experts += len(old_set - new_set)
            pairs += 2  # two MoE layers; the first one never changes
    assert 0 < changed_sets < pairs // 2, "perturbation too small or too large to test anything"
    assert moe.routing_volatility(model, micro, before) == {
        "routing_volatility": changed_sets / pairs,
        "routing_expert_change_frac": changed_experts / (2 * pairs),
    }


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_replay_of_the_own_routing_leaves_old_logprobs_unchanged(norm_topk_prob: bool) -> None:
    model = _model(norm_topk_prob)
    for mb in _packed():
        with torch.no_grad(), moe.record_routing(model) as routing:
            old = _logprobs(model, mb)
        with torch.no_grad(), moe.routing_replay(model, routing) as natural:
            replayed = _logprobs(model, mb)
        assert torch.equal(replayed, old)
        assert moe.routing_difference(routing, natural).changed_sets == 0


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_replay_uses_the_recorded_experts_after_the_router_changed(norm_topk_prob: bool) -> None:
    model, mb = _model(norm_topk_prob), _packed()[0]
    recorded = moe.expert_choices(model, mb)
    with torch.no_grad():
        for router in moe.moe_routers(model):
            router.weight.add_(
                0.3 * torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(2))
            )
    # during the replayed forward: what each router receives, and what the expert modules receive
    inputs: list[torch.Tensor] = []
    used: list[tuple[torch.Tensor, torch.Tensor]] = []  # (top_k_index, top_k_weights)
    blocks = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeSparseMoeBlock"]
    handles = [b.experts.register_forward_pre_hook(lambda m, a: used.append((a[1], a[2]))) for b in blocks]
    handles += [
        r.register_forward_pre_hook(lambda m, a: inputs.append(a[0].detach())) for r in moe.moe_routers(model)
    ]
    with moe.routing_replay(model, recorded) as natural:
        logp = _logprobs(model, mb)
    for h in handles:
        h.remove()
    assert moe.routing_difference(recorded, natural).changed_sets > 0, "the perturbation changed no routing"
    for layer, (experts, gates) in enumerate(used):
        assert torch.equal(experts, recorded.experts[layer])
        # gates: the current router's probabilities at the replayed experts (renormalised if it renormalises)
        probs = torch.softmax(inputs[layer] @ moe.moe_routers(model)[layer].weight.T, dim=-1)
        expected = probs.gather(1, recorded.experts[layer])
        if norm_topk_prob:
            expected = expected / expected.sum(-1, keepdim=True)
        torch.testing.assert_close(gates, expected)
    logp[mb.logprob_mask].sum().backward()  # the router still learns through the replayed gates
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in moe.moe_routers(model))


def test_replay_refuses_another_layout() -> None:
    model, micro = _model(), _packed()
    recorded = moe.expert_choices(model, micro[0])
    with pytest.raises(ValueError, match="same micro-batch layout"), moe.routing_replay(model, recorded):
        _logprobs(model, micro[1])


def _split_by_update(events: list[tuple]) -> list[list[tuple]]:
    """The events of each update (from its "update" marker to the next; the last ends with its last
    replayed forward's count), then those after the last update."""
    starts = [i for i, e in enumerate(events) if e[0] == "update"]
    end = max(i for i, e in enumerate(events) if e[0] == "replay") + 2  # + 2: past that forward's count
    bounds = [*starts, end]
    return [events[a + 1 : b] for a, b in itertools.pairwise(bounds)] + [events[end:]]


def test_trainer_logs_routing_volatility_and_replays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """train.routing_replay=true: every update's forward routes each token to the experts the old policy
    chose (its recorded routing), although the routers chose otherwise after the first update; the step's
    volatility metrics count those choices (after 1 update) and the routing after both updates."""
    events: list[tuple] = []  # ("update",), ("replay", used, recorded, natural), ("difference", result)
    replay, difference, update = moe.routing_replay, moe.routing_difference, learner.update

    @contextlib.contextmanager
    def spy_replay(model: torch.nn.Module, routing: moe.Routing):
        used: list[torch.Tensor] = []  # the experts each MoE block's expert modules receive
        blocks = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeSparseMoeBlock"]
        handles = [b.experts.register_forward_pre_hook(lambda m, a: used.append(a[1])) for b in blocks]
        with replay(model, routing) as natural:
            yield natural
        for h in handles:
            h.remove()
        events.append(("replay", used, routing, natural))

    def spy_difference(*args) -> moe.RoutingDifference:
        events.append(("difference", difference(*args)))
        return events[-1][1]

    def spy_update(*args) -> dict:
        events.append(("update",))
        return update(*args)

    monkeypatch.setattr(moe, "routing_replay", spy_replay)
    monkeypatch.setattr(moe, "routing_difference", spy_difference)
    monkeypatch.setattr(learner, "update", spy_update)
    overrides = ["model.tiny=qwen3_moe", "train.steps=1", "checkpoint.every=0", "train.minibatches=2"]
    config = tiny_config(tmp_path / "run", *overrides, "train.objective=grpo", "train.routing_replay=true")
    metrics = Trainer(config).train_step()

    # the events of each update: its replayed forwards, each followed by its count
    assert any(e[0] == "replay" for e in events), "no update replayed the old policy's routing"
    first, second, after = _split_by_update(events)
    for update_events in (first, second):
        replays = [e for e in update_events if e[0] == "replay"]
        assert replays, "an update ran without Routing Replay"
        for _, used, recorded, _ in replays:
            assert len(used) == len(recorded.experts) == 2  # both MoE layers replayed
            assert all(torch.equal(u, r) for u, r in zip(used, recorded.experts, strict=True))
    changed = [
        not torch.equal(old, own)
        for _, _, recorded, natural in (e for e in second if e[0] == "replay")
        for old, own in zip(recorded.experts, natural.experts, strict=True)
    ]
    assert any(changed), "the routers did not move after the first update: replay changed nothing"
    moved = sum((e[1] for e in second if e[0] == "difference"), moe.RoutingDifference())
    final = sum((e[1] for e in after if e[0] == "difference"), moe.RoutingDifference())  # post-step pass
    assert moved.changed_sets > 0 and final.changed_sets > 0
    assert metrics["routing_volatility_after_1_updates"] == moved.changed_sets / moved.pairs
    assert metrics["routing_expert_change_frac_after_1_updates"] == moved.changed_experts / moved.experts
    assert metrics["routing_volatility"] == final.changed_sets / final.pairs
    assert metrics["routing_expert_change_frac"] == final.changed_experts / final.experts
    assert not any(key.startswith("live_") for key in metrics)


def test_routing_replay_on_a_dense_model_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="Mixture-of-Experts"):
        Trainer(tiny_config(tmp_path / "run", "train.routing_replay=true"))


@pytest.mark.slow  # a cold start and 6 tiny runs: 20-25 s on 2 cores
def test_reduced_paper_experiment_writes_its_report(tmp_path: Path, script) -> None:
    argv = ["--reduced", "--runs-dir", str(tmp_path / "runs"), "--report-dir", str(tmp_path / "report")]
    assert script("reproduce_paper").main(argv) == 0
    report = (tmp_path / "report" / "paper_reproduction.md").read_text()
    assert report.count("Verdict: **") >= 5
    assert sorted(p.name for p in (tmp_path / "report").glob("*.png"))  # at least one plot
    for png in (tmp_path / "report").glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png.name})" in report
    summary = json.loads((tmp_path / "runs" / "summary.json").read_text())
    assert set(summary) == {"0.0003", "0.001"}  # the two learning rates
    assert all(set(table) == {"grpo", "grpo_replay", "gspo"} for table in summary.values())
    records = read_metrics(tmp_path / "runs" / "grpo_replay-lr0.0003-seed0")
    assert any("routing_volatility" in r for r in records)


@pytest.mark.parametrize("replay", [False, True])
def test_update_routing_replays_or_records_and_names_the_difference_by_updates(replay: bool) -> None:
    """The learner's bookkeeping (moe.UpdateRouting): the experts used are the old policy's with replay, the
    routers' own without; the difference of the routers' own choices to the old ones, named by updates."""
    model, mb = _model(), _packed()[0]
    recorded = moe.expert_choices(model, mb)
    with torch.no_grad():
        for router in moe.moe_routers(model):
            router.weight.add_(
                0.3 * torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(2))
            )
    own: list[torch.Tensor] = []  # each router's own choice, seen before the replay hook replaces it
    used: list[torch.Tensor] = []  # the experts the expert modules receive
    blocks = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeSparseMoeBlock"]
    handles = [r.register_forward_hook(lambda m, a, out: own.append(out[2])) for r in moe.moe_routers(model)]
    handles += [b.experts.register_forward_pre_hook(lambda m, a: used.append(a[1])) for b in blocks]
    routing = moe.UpdateRouting(model, [recorded], replay=replay)
    with torch.no_grad(), routing.forward(0, mb.logprob_mask):
        _logprobs(model, mb)
    for h in handles:
        h.remove()
    for layer, experts in enumerate(used):
        assert torch.equal(experts, recorded.experts[layer] if replay else own[layer])
    moved = moe.routing_difference(recorded, moe.Routing(own), mb.logprob_mask)
    assert moved.changed_sets > 0, "the perturbation changed no routing"
    assert routing.metrics(updates_before=2) == {
        "routing_volatility_after_2_updates": moved.changed_sets / moved.pairs,
        "routing_expert_change_frac_after_2_updates": moved.changed_experts / moved.experts,
    }
    assert routing.metrics(updates_before=0) == {}  # before the first update nothing moved
    assert moe.UpdateRouting(model, None, replay=replay).metrics(updates_before=1) == {}  # a dense model
