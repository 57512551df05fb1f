"""gspo's objectives against the peers' own loss code, on the same fixed tensors: loss and gradient to 1e-6.

TRL (installed by the dev extra): ``GRPOTrainer._compute_loss`` runs unchanged on a stand-in for ``self`` that
holds the attributes it reads; its importance-sampling ratios (formed inline in
``_generate_and_score_completions``) come from that method's own source block, executed as is. verl cannot be
imported without its distributed stack (ray, tensordict, hydra): its definitions are pinned by formulas
transcribed from volcengine/verl verl/trainer/ppo/core_algos.py and checked on hand-made tensors below.
Deliberate differences are pinned too; docs/faithfulness.md says why.
"""

from __future__ import annotations

import inspect
import math
import textwrap
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from gspo.config.trl import TRL_LOSSES
from gspo.core.objectives import LossInputs, LossSpec, compute_loss, policy_loss

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer", reason="TRL is part of the dev extra")
GRPOTrainer = trl_grpo.GRPOTrainer


def batch(seed: int = 0, B: int = 6, T: int = 5, spread: float = 0.3):
    """Fixed tensors: (B, T) log-probs with ragged lengths, sampler log-probs, advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([T, 1, 3, T, 2, 4][:B])
    mask = torch.arange(T) < lengths[:, None]
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    logp = old + spread * torch.randn(B, T, generator=g, dtype=torch.float64)
    sampler = old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return logp, old, sampler, adv, mask


class _Accelerator:
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def trl_loss(
    loss_type,
    level,
    logp,
    old,
    adv,
    mask,
    *,
    eps_low=0.2,
    eps_high=0.2,
    max_len=None,
    tau=(1.0, 1.05),
    is_mode=None,
    is_bounds=(None, 3.0),
    sampler=None,
    opsm=None,
):
    """TRL's GRPOTrainer._compute_loss on these tensors: (loss, d loss / d logp)."""
    logp = logp.detach().clone().requires_grad_()
    stub = SimpleNamespace(
        top_entropy_quantile=1.0,
        aux_loss_enabled=False,
        off_policy_mask_threshold=opsm,
        importance_sampling_level=level,
        beta=0.0,
        loss_type=loss_type,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        use_vllm=is_mode is not None,
        vllm_importance_sampling_correction=is_mode is not None,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=max_len or mask.shape[1],
        accelerator=_Accelerator(),
        _entropy_bonus_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask,
        args=SimpleNamespace(
            delta=None,
            sapo_temperature_pos=tau[0],
            sapo_temperature_neg=tau[1],
            use_bias_correction_kl=False,
            steps_per_generation=1,
        ),
    )
    stub._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logp, torch.zeros_like(logp), None)
    B, T = mask.shape
    fmask = mask.to(logp.dtype)
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": fmask,
        "advantages": adv,
        "old_per_token_logps": old,
        "num_items_in_batch": fmask.sum(),
    }
    if sampler is not None:
        inputs["sampling_per_token_logps"] = sampler
    if is_mode is not None:
        stub.vllm_importance_sampling_mode = is_mode
        stub.vllm_importance_sampling_clip_min, stub.vllm_importance_sampling_clip_max = is_bounds
        inputs["importance_sampling_ratio"] = trl_importance_ratio(stub, old, sampler, fmask)
    loss = GRPOTrainer._compute_loss(stub, None, inputs)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad


def trl_importance_ratio(stub, old, sampler, mask):
    """TRL's own block of `_generate_and_score_completions` that forms the vLLM importance-sampling ratio."""
    lines = inspect.getsource(GRPOTrainer._generate_and_score_completions).splitlines()
    start = next(
        i for i, line in enumerate(lines) if "# Compute the importance sampling ratio when using vLLM" in line
    )
    end = next(
        i
        for i, line in enumerate(lines)
        if "# Compute the per-token log probabilities for the reference" in line
    )
    block = textwrap.dedent("\n".join(lines[start:end]))
    scope = {
        "self": stub,
        "old_per_token_logps": old,
        "sampling_per_token_logps": sampler,
        "completion_mask": mask,
        "tool_mask": None,
        "torch": torch,
        "math": math,
    }
    exec(block, scope)
    return scope["vllm_importance_sampling_ratio"]


def ours(objective, logp, old, adv, mask, **kwargs):
    logp = logp.detach().clone().requires_grad_()
    loss, _ = ours_with_metrics(objective, logp, old, adv, mask, **kwargs)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad


def ours_with_metrics(objective, logp, old, adv, mask, sampler_logp=None, normalizer=None, **knobs):
    inputs = LossInputs.padded(logp, old, adv, mask, sampler_logp=sampler_logp, normalizer=normalizer)
    return compute_loss(LossSpec(objective, **knobs), inputs)


def assert_same(a, b):
    # float64 on both sides: the same formulas in another order differ by ~1e-15 on these O(1) values, and
    # verl's +1e-8 in its denominators by <= 1e-8; a formula that differs moves them by >= 1e-4 (see below)
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=1e-6)  # the gradients: the same bound


# GSPO / GRPO and the aggregations: TRL's loss_type x importance_sampling_level, as gspo.trl's GRPOConfig
# and the config's hints translate them (gspo.config.trl.TRL_LOSSES, the one table): LUSPO is GSPO's L_i
# times |y_i| over B; Dr. GRPO's token sums over B x max_completion_length; CISPO's paper and TRL average
# over tokens
CASES = [
    (loss, level, objective, aggregation) for (loss, level), (objective, aggregation) in TRL_LOSSES.items()
]


@pytest.mark.parametrize(("loss_type", "level", "objective", "aggregation"), CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_objectives_equal_trls(loss_type, level, objective, aggregation, seed):
    logp, old, _, adv, mask = batch(seed)
    B, max_len = mask.shape[0], 8
    kwargs = {"aggregation": aggregation}
    if aggregation == "seq-mean-token-sum-norm":
        kwargs["normalizer"] = B * max_len
    trl_kwargs = {"max_len": max_len}
    if objective == "sapo" or objective == "sapo_seq":
        kwargs |= {"tau_pos": 1.3, "tau_neg": 2.0}
        trl_kwargs["tau"] = (1.3, 2.0)
    elif objective == "cispo":  # TRL's epsilon_high is CISPO's absolute cap; ours is 1 + eps_high
        kwargs |= {"eps_low": 1.0, "eps_high": 0.25}
        trl_kwargs |= {"eps_high": 1.25}
    else:
        eps = (0.1, 0.15) if level == "token" else (0.002, 0.003)
        kwargs |= {"eps_low": eps[0], "eps_high": eps[1]}
        trl_kwargs |= {"eps_low": eps[0], "eps_high": eps[1]}
    expected = trl_loss(loss_type, level, logp, old, adv, mask, **trl_kwargs)
    got = ours(objective, logp, old, adv, mask, **kwargs)
    assert_same(got, expected)
    assert got[1].abs().sum() > 0


def test_the_cases_clip_something():
    """The fixed tensors exercise both branches: some tokens / sequences clipped, some not."""
    logp, old, _, adv, mask = batch(0)
    for objective, eps in [("grpo", (0.1, 0.15)), ("gspo", (0.002, 0.003)), ("cispo", (1.0, 0.25))]:
        _, m = policy_loss(objective, logp, old, adv, mask, eps_low=eps[0], eps_high=eps[1])
        assert 0 < m["clip_frac_token"] < 1, objective


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask"])
@pytest.mark.parametrize("objective", ["grpo", "cispo", "sapo"])
def test_token_importance_sampling_equals_trls(mode, objective):
    logp, old, sampler, adv, mask = batch(2)
    bounds = (0.9, 1.15)
    kwargs = {"eps_low": 1.0, "eps_high": 0.25} if objective == "cispo" else {}
    trl_kwargs = {"eps_low": 0.2, "eps_high": 1.25 if objective == "cispo" else 0.2}
    if objective == "grpo":
        kwargs = {"eps_low": 0.2, "eps_high": 0.2}
    aggregation = "token-mean" if objective == "cispo" else "seq-mean-token-mean"
    loss_type = {"grpo": "grpo", "cispo": "cispo", "sapo": "sapo"}[objective]
    expected = trl_loss(
        loss_type,
        "token",
        logp,
        old,
        adv,
        mask,
        is_mode=mode,
        is_bounds=bounds,
        sampler=sampler,
        **trl_kwargs,
    )
    got = ours(
        objective,
        logp,
        old,
        adv,
        mask,
        sampler_logp=sampler,
        sampler_correction=mode,
        sampler_correction_min=bounds[0],
        sampler_correction_max=bounds[1],
        aggregation=aggregation,
        **kwargs,
    )
    assert_same(got, expected)
    _, m = ours_with_metrics(
        objective,
        logp,
        old,
        adv,
        mask,
        sampler_logp=sampler,
        sampler_correction=mode,
        sampler_correction_min=bounds[0],
        sampler_correction_max=bounds[1],
        **kwargs,
    )
    changed = m["sampler_is_truncated_frac_token"] + m["sampler_is_masked_frac_token"]
    assert 0 < changed < 1  # the bounds bite on some tokens, not all


@pytest.mark.parametrize("mode", ["sequence_truncate", "sequence_mask"])
def test_sequence_importance_sampling_is_trls_on_the_length_normalised_ratio(mode):
    """Pinned difference: TRL's sequence ratio is the product exp(sum_t log rho_t), gspo's the length-normalised
    exp(mean_t log rho_t) (GSPO's s_i). Ours on sampler equals TRL's on sampler' whose per-token
    log rho is divided by |y_i|; on the raw sampler the two differ."""
    logp, old, sampler, adv, mask = batch(3)
    bounds = (0.9, 1.1)
    n = mask.sum(1, keepdim=True).to(old.dtype)
    scaled = old - (old - sampler) / n  # log rho'_t = log rho_t / |y_i|: sum_t log rho'_t = mean_t log rho_t
    correction = dict(
        sampler_correction=mode, sampler_correction_min=bounds[0], sampler_correction_max=bounds[1]
    )
    got = ours("gspo", logp, old, adv, mask, sampler_logp=sampler, **correction)
    same = trl_loss(
        "grpo",
        "sequence",
        logp,
        old,
        adv,
        mask,
        eps_low=3e-4,
        eps_high=4e-4,
        is_mode=mode,
        is_bounds=bounds,
        sampler=scaled,
    )
    assert_same(got, same)
    raw = trl_loss(
        "grpo",
        "sequence",
        logp,
        old,
        adv,
        mask,
        eps_low=3e-4,
        eps_high=4e-4,
        is_mode=mode,
        is_bounds=bounds,
        sampler=sampler,
    )
    assert (got[0] - raw[0]).abs() > 1e-4


@pytest.mark.parametrize(
    ("loss_type", "level", "objective"), [("grpo", "token", "grpo"), ("grpo", "sequence", "gspo")]
)
def test_off_policy_sequence_masking_equals_trls(loss_type, level, objective):
    logp, old, sampler, adv, mask = batch(4, spread=0.5)
    sampler = sampler + 0.3  # the sampler more confident than the current policy: KL_i > 0 for some
    eps = (0.2, 0.2) if level == "token" else (0.02, 0.03)
    expected = trl_loss(
        loss_type, level, logp, old, adv, mask, eps_low=eps[0], eps_high=eps[1], sampler=sampler, opsm=0.3
    )
    got = ours(
        objective, logp, old, adv, mask, eps_low=eps[0], eps_high=eps[1], sampler_logp=sampler, opsm_delta=0.3
    )
    assert_same(got, expected)
    _, m = ours_with_metrics(objective, logp, old, adv, mask, sampler_logp=sampler, opsm_delta=0.3)
    assert 0 < m["opsm_masked_frac_seq"] < 1


# ---- verl: definitions transcribed from volcengine/verl verl/trainer/ppo/core_algos.py (b178a3c), pinned by hand
def verl_geo_mean(old, logp, adv_tok, mask, low, high):
    """compute_policy_loss_geo_mean: sign trick, no clamp, mean over all B, response_mask_sum + 1e-8."""
    lr = logp - old
    sgn = torch.sign(adv_tok)
    m = sgn * torch.min(sgn * lr, sgn * torch.clamp(lr, -low, high))
    n = mask.sum(-1)
    ratio = torch.exp((m * mask).sum(-1) / (n + 1e-8))
    advantage = (adv_tok * mask).sum(-1) / (n + 1e-8)
    return torch.mean(-advantage * ratio)


def verl_cispo(old, logp, adv_tok, mask, low, high):
    """compute_policy_loss_cispo with agg_loss token-mean: -sg(clip(r, 1-low, 1+high)) A logp over tokens."""
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    losses = -torch.clamp(ratio, 1 - low, 1 + high).detach() * adv_tok * logp
    return (losses * mask).sum() / mask.sum()


def verl_sapo(old, logp, adv_tok, mask, tau_pos, tau_neg):
    """compute_policy_loss_sapo: token gate, seq-mean-token-mean over the non-empty sequences."""
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    taus = torch.where(adv_tok > 0, tau_pos, tau_neg)
    losses = -torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus) * adv_tok
    n = mask.sum(-1)
    return ((losses * mask).sum(-1) / (n + 1e-8)).sum() / (n > 0).sum()


@pytest.mark.parametrize(
    ("objective", "verl", "knobs"),
    [
        ("gmpo", verl_geo_mean, (0.4, 0.4)),
        ("cispo", verl_cispo, (1.0, 0.25)),
        ("sapo", verl_sapo, (1.0, 1.05)),
    ],
)
def test_verl_definitions_pinned(objective, verl, knobs):
    logp, old, _, adv, mask = batch(5, spread=0.6)
    adv_tok = adv[:, None].expand(mask.shape)
    leaf = logp.detach().clone().requires_grad_()
    expected = verl(old, torch.where(mask, leaf, old), adv_tok, mask.to(old.dtype), *knobs)
    (expected_grad,) = torch.autograd.grad(expected, leaf)
    kwargs = (
        {"tau_pos": knobs[0], "tau_neg": knobs[1]}
        if objective == "sapo"
        else dict(zip(("eps_low", "eps_high"), knobs, strict=True))
    )
    aggregation = "token-mean" if objective == "cispo" else "seq-mean-token-mean"
    got = ours(objective, logp, old, adv, mask, aggregation=aggregation, **kwargs)
    assert_same(got, (expected.detach(), expected_grad))
    # hand check of the transcription on one token: GMPO with A = +1 and log r = 0.5 > 0.4 gives e^0.4
    one = verl_geo_mean(
        torch.zeros(1, 1), torch.full((1, 1), 0.5), torch.ones(1, 1), torch.ones(1, 1), 0.4, 0.4
    )
    assert one.item() == pytest.approx(-math.exp(0.4), rel=1e-6)
