"""The learner on its own: no Trainer, no run folder. The one road (make_batch), learn(), metric reduction."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from gspo.core.advantages import group_advantages
from gspo.core.layout import TokenSequence
from gspo.core.objectives import LossSpec
from gspo.core.samples import Sample
from gspo.learning import learner
from gspo.learning.batch import Batch, make_batch
from gspo.learning.learner import learn, minibatches
from gspo.learning.policy import Policy, UpdateSpec
from gspo.learning.reduction import reduce_metrics
from gspo.models import tiny_model


def _samples(rewards: list[float], group_size: int) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i, r in enumerate(rewards):
        n = 2 + i % 3
        completion = torch.randint(3, 60, (n,), generator=g).tolist()
        out.append(Sample([5, 6, 7], completion, [-1.0] * n, r, group=i // group_size, truncated=i % 4 == 3))
    return out


def test_make_batch_advantages_are_group_advantages_and_metrics_are_the_batch_s():
    rewards = [1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 2.0, 2.0]  # group 1 has no spread
    batch, metrics = make_batch(_samples(rewards, 4))
    expected, _ = group_advantages(torch.tensor(rewards), 4)
    assert torch.equal(batch.advantages, expected)
    assert batch.groups == [0, 0, 0, 0, 1, 1, 1, 1]
    assert metrics["reward_mean"] == pytest.approx(sum(rewards) / 8)
    mean = sum(rewards) / 8
    assert metrics["reward_std"] == pytest.approx(
        math.sqrt(sum((r - mean) ** 2 for r in rewards) / 8)
    )  # population
    assert metrics["zero_std_groups"] == 1.0 and metrics["num_trained"] == 8.0
    assert metrics["truncated_frac"] == 0.25
    assert metrics["completion_len_mean"] == pytest.approx(sum(2 + i % 3 for i in range(8)) / 8)


def test_make_batch_filters_zero_spread_groups_and_masks_truncated_samples():
    rewards = [1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 2.0, 2.0]
    batch, metrics = make_batch(_samples(rewards, 4), filter_zero_std_groups=True, mask_truncated=True)
    assert len(batch.sequences) == 4 and batch.groups == [0, 0, 0, 0]
    assert metrics["num_trained"] == 4.0 and metrics["reward_mean"] == pytest.approx(sum(rewards) / 8)
    assert [any(s.train_mask) for s in batch.sequences] == [True, True, True, False]  # sample 3 truncated


def test_make_batch_per_turn_returns_give_per_token_advantages():
    # two 2-turn samples of one group; tokens of turn 0, context (-1), then turn 1
    samples = [
        Sample([1], [5, 6, 7, 8], [0.0] * 4, 1.0, 0, turns=[0, -1, 1, 1], turn_rewards=[0.5, 0.0]),
        Sample([1], [5, 6, 7, 8], [0.0] * 4, 0.0, 0, turns=[0, -1, 1, 1], turn_rewards=[0.0, 0.0]),
    ]
    batch, metrics = make_batch(samples)
    # returns-to-go: [1.5, 1.0] and [0.0, 0.0]; baseline = mean total 0.75; std over {1.5, 1, 0, 0}
    values = torch.tensor([1.5, 1.0, 0.0, 0.0])
    std = float(values.std(unbiased=False)) + 1e-6
    a = [(1.5 - 0.75) / std, (1.0 - 0.75) / std, (0.0 - 0.75) / std]
    assert batch.advantages[0] == pytest.approx([a[0], 0.0, a[1], a[1]])
    assert batch.advantages[1] == pytest.approx([a[2], 0.0, a[2], a[2]])
    assert metrics["reward_mean"] == pytest.approx(0.75)


def _policy(seed: int = 0, sgd: bool = False) -> Policy:
    model = tiny_model("llama", vocab_size=64, seed=seed)
    if sgd:  # the update is the gradient itself: parameters compare gradients
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    return Policy(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0))


def _batch() -> Batch:
    g = torch.Generator().manual_seed(1)
    sequences = []
    for i in range(12):
        prompt = torch.randint(3, 60, (3 + i % 4,), generator=g).tolist()
        completion = torch.randint(3, 60, (2 + i % 5,), generator=g).tolist()
        sequences.append(TokenSequence(prompt, completion, [True] * len(completion)))
    advantages = torch.randn(12, generator=g)
    return Batch(
        sequences,
        advantages,
        [[float("nan")] * len(s.completion_ids) for s in sequences],
        [i // 4 for i in range(12)],
    )


def _params(policy: Policy) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in policy.model.parameters()])


def test_learn_without_a_trainer_updates_and_is_deterministic(monkeypatch):
    spec = UpdateSpec(LossSpec("gspo", eps_low=0.2, eps_high=0.2), minibatches=3)
    runs, counted, updates = [], [], []
    update = learner.update
    monkeypatch.setattr(learner, "update", lambda *a: updates.append(update(*a)) or updates[-1])
    for _ in range(2):
        policy = _policy()
        before = _params(policy)
        metrics = learn(policy, spec, _batch(), seed=7, around_update=lambda: _Count(counted))
        runs.append(_params(policy))
        assert not torch.equal(before, runs[-1])
    assert torch.equal(runs[0], runs[1])
    assert counted == [1] * 6  # the hook wrapped each of the 3 updates, twice
    # the first minibatch is on-policy: its ratios are exactly 1, the later ones moved
    first, *later = updates[3:]
    assert (first["ratio_token_min"], first["ratio_token_max"], first["clip_frac_token"]) == (1.0, 1.0, 0.0)
    assert all(max(u["ratio_token_max"] - 1, 1 - u["ratio_token_min"]) > 1e-4 for u in later)
    assert metrics["ratio_token_min"] == min(u["ratio_token_min"] for u in updates[3:])
    assert "sampler_logprob_abs_diff" not in metrics  # the sampler reported no log-probs to compare
    assert metrics["update_tokens"] == metrics["real_tokens"] == sum(len(s) for s in _batch().sequences)
    assert all(math.isfinite(v) for v in metrics.values())


def test_learn_accumulation_over_micro_batches_equals_one_micro_batch_per_minibatch():
    params = {}
    for tokens in (16, 4096):  # many micro-batches per minibatch vs one
        policy = _policy(sgd=True)
        spec = UpdateSpec(LossSpec("grpo"), minibatches=2, micro_batch_tokens=tokens, pack_length=16)
        layout = minibatches(spec, _batch().sequences, seed=3, device=torch.device("cpu"))
        assert [len(micro) > 1 for _, micro, *_ in layout] == [tokens == 16] * 2
        metrics = learn(policy, spec, _batch(), seed=3)
        params[tokens] = _params(policy)
        assert metrics["loss"] == metrics["loss"]  # finite
    moved = float((params[4096] - _params(_policy(sgd=True))).abs().max())
    # fp32 sums in another grouping: per SGD update each gradient element is off by <= n*u*sum|terms|, n ~ 1e3
    # (~100 tokens, and the forward/backward path), sum|terms| <= 2 max|g| here: ~1e-4 max|g|, and the two
    # updates' max|g| sum to ~2 moved: ~2e-4 moved; a micro-batch weighed wrongly moves them by O(moved)
    torch.testing.assert_close(params[16], params[4096], rtol=0, atol=1e-3 * moved)


def _group_batch(per_token: bool = False) -> Batch:
    """Four groups of 3 samples sharing their group's prompt: a 3-token system message and 1, 4 or 7 tokens
    of its own, the fourth group's the second's and 6 more; advantages per sequence or per token."""
    g = torch.Generator().manual_seed(5)
    system = torch.randint(3, 60, (3,), generator=g).tolist()
    sequences, groups, prompts = [], [], []
    for group in range(4):
        start = prompts[1] if group == 3 else system
        prompt = start + torch.randint(3, 60, (1 + 3 * group - len(start) + 3,), generator=g).tolist()
        prompts.append(prompt)
        for _ in range(3):
            completion = torch.randint(
                3, 60, (int(torch.randint(1, 6, (), generator=g)),), generator=g
            ).tolist()
            sequences.append(TokenSequence(prompt, completion, [True] * len(completion)))
            groups.append(group)
    if per_token:
        advantages = [torch.randn(len(s.completion_ids), generator=g).tolist() for s in sequences]
    else:
        advantages = torch.randn(len(sequences), generator=g)
    return Batch(sequences, advantages, [[float("nan")] * len(s.completion_ids) for s in sequences], groups)


def _model_policy(family: str, beta: float) -> Policy:
    import copy

    model = tiny_model(family.split("+")[0], vocab_size=64, seed=0)
    if family.endswith("lora"):
        from gspo.config import LoraConfig
        from gspo.models import add_lora

        model = add_lora(model, LoraConfig(rank=4, target_modules=["q_proj", "v_proj"]))
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.1, generator=torch.Generator().manual_seed(0))
    reference = copy.deepcopy(model).requires_grad_(False) if beta and not family.endswith("lora") else None
    # lr 0.5: at 1.0 grpo's KL term diverges (KL 4e3 by the third update), amplifying rounding past any bound
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    return Policy(
        model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0), reference=reference
    )


CASES = [
    ("llama", "gspo", {}),
    ("llama", "gspo_token", {"per_token": True}),
    ("llama", "grpo", {"per_token": True, "beta": 0.1}),
    ("llama+lora", "gspo", {"beta": 0.1}),
    ("qwen3_moe", "gspo", {}),
    ("qwen3_moe", "grpo", {"routing_replay": True}),
]


@pytest.mark.parametrize(
    ("family", "objective", "options"), CASES, ids=[f"{f}-{o}-{sorted(x)}" for f, o, x in CASES]
)
def test_shared_prefix_updates_equal_the_padded_layout_s(family, objective, options):
    """Three SGD updates (so parameter changes are the gradients, scaled) on whole-group minibatches,
    shared-prefix rows vs one padded row per sequence. Tolerance: fp32 sums in another order (attention over
    a tree, against a padded row), compounded over the updates (bounds below). MoE: top-k routing would turn
    a rounding-level difference into another expert for a token at a near-tie; here every token's top-2
    router logits lead the third by >= 1.9e-4 (seeded weights and batch), ~100x their rounding (~sqrt(n) u
    with n ~ 1e3 along the path: 2e-6)."""
    per_token, beta = options.get("per_token", False), options.get("beta", 0.0)
    results = {}
    for layout in ("shared_prefix", "padded"):
        policy = _model_policy(family, beta)
        spec = UpdateSpec(
            LossSpec(objective, eps_low=0.02, eps_high=0.02, beta=beta),
            minibatches=3,
            layout=layout,
            minibatch_split="group",
            routing_replay=options.get("routing_replay", False),
            max_grad_norm=0.0,
        )
        batch = _group_batch(per_token)
        metrics = learn(policy, spec, batch, seed=11)
        results[layout] = (_params(policy), metrics)
    (shared, m_shared), (padded, m_padded) = results["shared_prefix"], results["padded"]
    # fewer than a group's prompt once: groups of one minibatch share their prompts' common start
    assert m_shared["update_tokens"] < m_shared["unique_tokens"] < m_padded["update_tokens"]
    assert 0 < m_padded["clip_frac_token"] < 1  # clipping is exercised
    moved = (padded - _params(_model_policy(family, beta))).abs().max()
    assert moved > 1e-3
    # per update each gradient element is off by <= n*u*sum|terms|, n ~ 1e3 (~100 tokens, and the forward/
    # backward path), sum|terms| <= 3 max|g| here: ~2e-4 max|g|, and the updates' lr max|g| sum to ~2 moved:
    # ~4e-4 moved; a layout bug (a token seeing another sequence's tokens, a wrong position) is O(moved)
    torch.testing.assert_close(shared, padded, rtol=0, atol=1e-3 * float(moved))
    for key in ("loss", "clip_frac_token", "ratio_seq_mean", "grad_norm", "num_tokens"):
        # sums over the same tokens at parameters within that bound: the same ~2e-4 relative per update
        assert m_shared[key] == pytest.approx(m_padded[key], rel=1e-3, abs=1e-7), key


def test_group_minibatches_hold_whole_groups_and_sample_minibatches_do_not():
    batch = _group_batch()
    for split in ("group", "sample"):
        spec = UpdateSpec(minibatches=2, minibatch_split=split)
        layout = minibatches(spec, batch.sequences, seed=4, device=torch.device("cpu"), groups=batch.groups)
        assert sorted(i for ids, *_ in layout for i in ids) == list(range(12))
        groups_per_minibatch = [sorted({batch.groups[i] for i in ids}) for ids, *_ in layout]
        if split == "group":  # 4 groups of 3 in 2 minibatches: 2 whole groups each
            assert (
                all(len(ids) == 6 for ids, *_ in layout)
                and len({g for gs in groups_per_minibatch for g in gs}) == 4
            )
            assert not set(groups_per_minibatch[0]) & set(groups_per_minibatch[1])
        else:  # 12 samples in 2 minibatches of 6: some group is cut between them (for this seed)
            assert set(groups_per_minibatch[0]) & set(groups_per_minibatch[1])


def test_the_sampler_s_logprobs_as_the_old_policy_s_skip_the_recompute_and_still_measure_the_mismatch():
    policy = _policy(sgd=True)
    batch = _group_batch()
    # the sampler's log-probs: the policy's own, off by a known 1e-3 on every token
    spec = UpdateSpec(minibatches=2, old_logprobs="recompute")
    from gspo.learning.policy import score

    with torch.no_grad():
        for ids, micro, *_ in minibatches(
            spec, batch.sequences, seed=1, device=torch.device("cpu"), groups=batch.groups
        ):
            for mb in micro:
                flat = score(policy.model, mb, spec)
                for k, i in enumerate(mb.indices):
                    batch.sampler_logprobs[ids[i]] = (flat[mb.segment_ids == k] - 1e-3).tolist()
    metrics = learn(policy, UpdateSpec(minibatches=2, old_logprobs="sampler"), batch, seed=1)
    assert metrics["old_logprobs_recomputed"] == 0.0
    # measured on the first minibatch's own forward: log pi_old - log pi_sampler = 1e-3 on every token
    assert metrics["sampler_logprob_abs_diff"] == pytest.approx(1e-3, rel=1e-3)
    assert metrics["sampler_seq_log_ratio_mean"] == pytest.approx(1e-3, rel=1e-3)
    assert metrics["sampler_seq_outside_clip_frac"] == 1.0  # exp(1e-3) > 1 + 4e-4: GSPO would clip them


class _Count:
    def __init__(self, calls: list[int]) -> None:
        self.calls = calls

    def __enter__(self) -> None:
        self.calls.append(1)

    def __exit__(self, *exc: object) -> None:
        pass


def test_reduce_metrics_averages_each_key_over_the_items_that_have_it():
    items = [
        {"loss": torch.tensor(1.0), "clip_frac_seq": 0.5, "kl": torch.tensor(0.25, dtype=torch.float64)},
        {"loss": torch.tensor(2.0), "clip_frac_seq": torch.tensor(0.0)},
        {"loss": 6.0},
    ]
    assert reduce_metrics(items) == {"loss": 3.0, "clip_frac_seq": 0.25, "kl": 0.25}
    extremes = [
        {"ratio_min": 0.5, "ratio_max": 1.5, "num_tokens": 3.0},
        {"ratio_min": 0.9, "ratio_max": 2.0, "num_tokens": 4.0},
    ]
    assert reduce_metrics(extremes) == {"ratio_min": 0.5, "ratio_max": 2.0, "num_tokens": 7.0}
    assert reduce_metrics([]) == {}
    assert math.isnan(reduce_metrics([{"x": torch.tensor(float("nan"))}, {"x": 1.0}])["x"])


def test_reduce_metrics_reads_tensors_back_with_one_sync(monkeypatch):
    calls = []
    real_tolist = torch.Tensor.tolist

    def counting_tolist(self):
        calls.append(self.shape)
        return real_tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail(".item() called"))
    items = [{f"k{i}": torch.tensor(float(i + j)) for i in range(5)} for j in range(4)]
    assert reduce_metrics(items) == {f"k{i}": i + 1.5 for i in range(5)}
    assert calls == [torch.Size([20])]


def _drifted_sampler(batch: Batch, old: list[torch.Tensor]) -> list[float]:
    """Sampler log-probs a known distance from the old policy's: a fifth of the tokens unknown (NaN, but
    never a whole sequence), each sequence's known tokens shifted by d_i = n/k (every third sequence: far,
    mean log(pi_sampler / pi_old) over its n tokens = +1) or -n/(2k) (near: -0.5); returns the d_i."""
    g = torch.Generator().manual_seed(3)
    shifts, sampled = [], []
    for i, lp in enumerate(old):
        unknown = torch.rand(len(lp), generator=g) < 0.2
        unknown[0] = False
        n, k = len(lp), int((~unknown).sum())
        shifts.append(n / k if i % 3 == 0 else -n / (2 * k))
        sampled.append(torch.where(unknown, float("nan"), lp + shifts[-1]).tolist())
    batch.sampler_logprobs = sampled
    return shifts


def _naive_mismatch_metrics(
    spec: UpdateSpec, batch: Batch, shifts: list[float], seed: int
) -> dict[str, float]:
    """The corrections' metrics one sequence at a time, reduced as the learner reduces them: the mean over
    updates of the mean over micro-batches. rho = pi_old / pi_sampler: exp(-d_i) per known token, 1 per
    unknown one, exp(mean over the tokens) per sequence; OPSM drops A_i < 0 with KL_i (+1 or -0.5, up to the
    drift of the current policy) > delta."""
    loss = spec.loss
    low, high = loss.sampler_correction_min, loss.sampler_correction_max
    per_update = []
    for ids, micro, *_ in minibatches(
        spec, batch.sequences, seed=seed, device=torch.device("cpu"), groups=batch.groups
    ):
        per_micro = []
        for mb in micro:
            flagged = weight = dropped = tokens = 0.0
            for i in (ids[j] for j in mb.indices):
                known = [not math.isnan(x) for x in batch.sampler_logprobs[i]]
                log_rho = [-shifts[i] if k else 0.0 for k in known]
                if loss.sampler_correction.startswith("sequence"):
                    log_rho = [sum(log_rho) / len(log_rho)] * len(log_rho)
                for rho in map(math.exp, log_rho):
                    outside = not low <= rho <= high
                    flagged += outside
                    if loss.sampler_correction.endswith("truncate"):
                        weight += min(max(rho, low), high)
                    else:
                        weight += 0.0 if outside else rho
                tokens += len(log_rho)
                kl = shifts[i] * sum(known) / len(known)
                dropped += (
                    loss.opsm_delta is not None and float(batch.advantages[i]) < 0 and kl > loss.opsm_delta
                )
            kind = "truncated" if loss.sampler_correction.endswith("truncate") else "masked"
            per_micro.append(
                {
                    f"sampler_is_{kind}_frac_token": flagged / tokens,
                    "sampler_is_weight_mean": weight / tokens,
                    "opsm_masked_frac_seq": dropped / len(mb.indices),
                }
            )
        per_update.append({k: sum(m[k] for m in per_micro) / len(per_micro) for k in per_micro[0]})
    return {k: sum(u[k] for u in per_update) / len(per_update) for k in per_update[0]}


@pytest.mark.parametrize(
    ("objective", "correction", "opsm_delta"),
    [
        ("gmpo", "none", None),
        ("sapo", "token_mask", None),
        ("sapo_seq", "sequence_truncate", 0.0),
        ("cispo", "token_truncate", None),
        ("gspo", "sequence_mask", 0.5),
    ],
)
def test_every_objective_and_correction_trains_through_the_learner(
    objective, correction, opsm_delta, rollout_logprobs
):
    """Each objective trains through the learner with the sampler's log-probs; the corrections weigh by
    them exactly (rho from the sampler's and the old policy's log-probs, NaN as ratio 1), and OPSM drops
    the negative-advantage sequences that drifted."""
    batch, policy = _batch(), _policy()
    sequences = batch.sequences
    rollouts = SimpleNamespace(
        prompt_ids=[s.prompt_ids for s in sequences], completion_ids=[s.completion_ids for s in sequences]
    )
    shifts = _drifted_sampler(batch, rollout_logprobs(policy.model, rollouts))
    bounds = {} if correction == "none" else dict(sampler_correction_min=0.5, sampler_correction_max=2.0)
    loss = LossSpec(objective, sampler_correction=correction, opsm_delta=opsm_delta, **bounds)
    spec = UpdateSpec(loss, minibatches=2, old_logprobs="recompute")
    before = _params(policy)
    metrics = learn(policy, spec, batch, seed=3)
    assert not torch.equal(before, _params(policy))
    assert all(math.isfinite(v) for v in metrics.values())
    if correction == "none":
        assert not any(key.startswith("sampler_is_") for key in metrics)
        return
    expected = _naive_mismatch_metrics(spec, batch, shifts, seed=3)
    if opsm_delta is None:
        del expected["opsm_masked_frac_seq"]
    assert (
        expected["sampler_is_weight_mean"] > 0 and 0 < next(iter(expected.values())) < 1
    )  # both kinds occur
    assert {k: metrics[k] for k in expected} == pytest.approx(expected, rel=1e-5)


def test_dr_grpo_normaliser_is_the_sequences_times_the_longest_completion():
    """seq-mean-token-sum-norm divides the token sums by B x max_new_tokens: with SGD the update is exactly the
    seq-mean-token-sum update (over B) divided by max_new_tokens."""
    updates = {}
    for aggregation, k in [("seq-mean-token-sum", 1), ("seq-mean-token-sum-norm", 8)]:
        policy = _policy(sgd=True)
        before = _params(policy)
        spec = UpdateSpec(
            LossSpec("grpo", aggregation=aggregation), minibatches=1, max_new_tokens=k, max_grad_norm=0
        )
        learn(policy, spec, _batch(), seed=2)
        updates[aggregation] = _params(policy) - before
    torch.testing.assert_close(updates["seq-mean-token-sum-norm"] * 8, updates["seq-mean-token-sum"])


def test_extremes_leave_out_the_micro_batches_that_measured_nothing() -> None:
    """A micro-batch (or rank) with no trained token reports the extremes' identities, not 0: the
    minimum over it and a measured 0.9 is 0.9; with nothing measured anywhere the extreme is 0."""
    from gspo.core.objectives import _stats

    empty = _stats(torch.tensor([0.5, 2.0]), torch.tensor([False, False]), "ratio_token")
    measured = _stats(torch.tensor([0.9, 1.2, 7.0]), torch.tensor([True, True, False]), "ratio_token")
    assert {k: v.item() for k, v in empty.items()} == {
        "ratio_token_mean": 0.0,
        "ratio_token_min": math.inf,
        "ratio_token_max": -math.inf,
    }
    reduced = reduce_metrics([empty, measured])
    assert reduced["ratio_token_min"] == pytest.approx(0.9) and reduced["ratio_token_max"] == pytest.approx(
        1.2
    )
    assert reduce_metrics([empty]) == {
        "ratio_token_mean": 0.0,
        "ratio_token_min": 0.0,
        "ratio_token_max": 0.0,
    }


@pytest.mark.parametrize("layout", ["shared_prefix", "padded"])
def test_a_tied_embedding_s_rows_give_the_weight_autograd_s_own_gradient(layout):
    """The tied input embedding's gradient added by rows (gspo.learning.embedding_rows) against autograd's
    dense embedding backward: two SGD updates (parameter changes are the gradients, unclipped), several
    micro-batches per minibatch. The embedding's padding_idx is a token the prompts hold: autograd gives its
    row no gradient from the lookup, nor must the rows. Tolerance: fp32 sums in another order."""
    results = {}
    for rows in (True, False):
        policy = _policy(sgd=True)
        embedding = policy.model.get_input_embeddings()
        embedding.padding_idx = _batch().sequences[0].prompt_ids[0]
        assert policy.tied_rows.enabled
        policy.tied_rows.enabled = rows
        before = embedding.weight.detach().clone()
        spec = UpdateSpec(
            LossSpec("gspo", eps_low=0.2, eps_high=0.2),
            minibatches=2,
            layout=layout,
            micro_batch_tokens=24,
            pack_length=24,
            max_grad_norm=0.0,
        )
        learn(policy, spec, _batch(), seed=5)
        assert not embedding._forward_hooks and not policy.tied_rows.rows  # nothing left behind
        results[rows] = (_params(policy), embedding.weight.detach() - before)
    (by_rows, _), (dense, moved) = results[True], results[False]
    assert moved.abs().max() > 1e-3  # the embedding trained
    # fp32 sums in another order: per update each element is off by <= n*u*sum|terms|, n ~ 1e3 (~100 tokens,
    # and the forward/backward path), sum|terms| <= max|g| here: ~6e-5 max|g|, twice (~1e-4 moved); a row's
    # gradient lost or doubled, or padding_idx's row given its lookup gradient (0.2 moved), is far above
    torch.testing.assert_close(by_rows, dense, rtol=0, atol=1e-3 * float(moved.abs().max()))


def test_rows_only_for_a_trainable_embedding_tied_to_the_head_in_one_process():
    from gspo.learning.embedding_rows import TiedRows

    model = tiny_model("llama", vocab_size=64, seed=0)
    assert TiedRows(model, one_process=True).enabled
    assert not TiedRows(model, one_process=False).enabled  # DDP/FSDP2 reduce inside the backward
    model.get_input_embeddings().weight.requires_grad_(False)  # LoRA's frozen embedding
    assert not TiedRows(model, one_process=True).enabled
    untied = tiny_model("llama", vocab_size=64, seed=0)
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    assert not TiedRows(untied, one_process=True).enabled
