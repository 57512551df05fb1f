"""group_advantages: hand values for every scale, zero-std groups, and errors."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gspo.core.advantages import group_advantages

# group 0: [1, 2, 3, 4] (mean 2.5, population std sqrt(1.25)); group 1: constant; group 2: [1, 0, 1, 0]
REWARDS = torch.tensor([1.0, 2.0, 3.0, 4.0, 7.0, 7.0, 7.0, 7.0, 1.0, 0.0, 1.0, 0.0])
CENTERED = [-1.5, -0.5, 0.5, 1.5, 0.0, 0.0, 0.0, 0.0, 0.5, -0.5, 0.5, -0.5]


def test_scale_group_hand_values():
    adv, zero = group_advantages(REWARDS, 4, eps=0.0)
    std0, std2 = math.sqrt(1.25), 0.5
    expected = [c / std0 for c in CENTERED[:4]] + [0.0] * 4 + [c / std2 for c in CENTERED[8:]]
    torch.testing.assert_close(adv, torch.tensor(expected))
    assert adv.dtype == torch.float32
    assert zero.tolist() == [False, True, False]


def test_scale_group_eps_in_denominator():
    adv, _ = group_advantages(torch.tensor([0.0, 1.0]), 2, eps=0.5)
    torch.testing.assert_close(adv, torch.tensor([-0.5, 0.5]) / (0.5 + 0.5))


def test_scale_batch_hand_values():
    adv, zero = group_advantages(REWARDS, 4, scale="batch", eps=0.0)
    # std of all 12 raw rewards: sum 40, sum of squares 228, var = 228/12 - (40/12)^2 = 71/9
    batch_std = math.sqrt(71 / 9)
    torch.testing.assert_close(adv, torch.tensor(CENTERED) / batch_std)
    assert zero.tolist() == [False, True, False]


def test_scale_none_hand_values():
    adv, _ = group_advantages(REWARDS, 4, scale="none")
    assert adv.tolist() == CENTERED


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_zero_std_groups_are_exactly_zero(scale):
    # 0.1 three times: the float32 mean is not exactly 0.1, so r - mean would be ~1e-9, not 0
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.3, 0.9, 0.2])
    adv, zero = group_advantages(rewards, 3, scale=scale)
    assert (adv[:3] == 0).all()
    assert (adv[3:] != 0).all()
    assert zero.tolist() == [True, False]


def test_group_size_one_gives_zeros_and_flags_every_group():
    adv, zero = group_advantages(torch.tensor([1.0, -2.0, 3.0]), 1)
    assert adv.tolist() == [0.0, 0.0, 0.0]
    assert zero.tolist() == [True, True, True]


def test_integer_and_bool_rewards_and_empty_batch():
    adv, _ = group_advantages(torch.tensor([1, 0, 0, 0]), 2, scale="none")
    assert adv.tolist() == [0.5, -0.5, 0.0, 0.0]
    adv, _ = group_advantages(torch.tensor([True, False]), 2, eps=0.0)
    assert adv.tolist() == [1.0, -1.0]
    adv, zero = group_advantages(torch.zeros(0), 4, scale="batch")
    assert adv.shape == (0,) and zero.shape == (0,)


@settings(max_examples=30, deadline=None)
@given(
    rewards=st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=1, max_size=24),
    group_size=st.integers(1, 6),
)
def test_groups_are_centred_and_unit_std(rewards, group_size):
    rewards = rewards[: len(rewards) // group_size * group_size] or [0.0] * group_size
    r = torch.tensor(rewards)
    adv, zero = group_advantages(r, group_size)
    grouped = adv.view(-1, group_size)
    spread = r.view(-1, group_size).std(1, unbiased=False)
    for g in range(len(zero)):
        assert zero[g] == (r.view(-1, group_size)[g] == r.view(-1, group_size)[g, 0]).all()
        if zero[g]:  # no signal: exactly zero, by construction
            assert (grouped[g] == 0).all()
        if spread[g] > 1e-2:  # well above eps and the float32 error of the mean
            # the fp32 group mean is off by <= n*u*max|r| = 6 * 2^-24 * 10 = 3.6e-6, the advantages' mean by
            # that over the std: <= 3.6e-4; a wrong baseline is off by O(1)
            assert grouped[g].mean().item() == pytest.approx(0.0, abs=1e-3)
            # std of the advantages: std / (std + eps) >= 1 - 1e-4, plus fp32 rounding ~1e-6
            assert grouped[g].std(unbiased=False).item() == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_reward_names_sample_index(bad):
    rewards = REWARDS.clone()
    rewards[9] = bad
    with pytest.raises(ValueError, match=r"sample index 9 \(group 2\) is (nan|inf|-inf)"):
        group_advantages(rewards, 4)


def test_batch_not_divisible_names_both_numbers():
    with pytest.raises(ValueError, match="batch size 10 is not divisible by group_size 3"):
        group_advantages(torch.zeros(10), 3)


@pytest.mark.parametrize("group_size", [0, -2])
def test_group_size_below_one(group_size):
    with pytest.raises(ValueError, match=f"group_size must be >= 1, got {group_size}"):
        group_advantages(torch.zeros(4), group_size)


def test_unknown_scale_and_bad_shape():
    with pytest.raises(ValueError, match="unknown scale 'std'"):
        group_advantages(torch.zeros(4), 2, scale="std")
    with pytest.raises(ValueError, match=r"rewards must be \(B,\) or \(B, K\), got shape \(2, 2, 1\)"):
        group_advantages(torch.zeros(2, 2, 1), 2)
    with pytest.raises(ValueError, match=r"groups must be \(4,\) group ids"):
        group_advantages(torch.zeros(4), torch.zeros(3, dtype=torch.long))


def test_group_ids_of_any_sizes_equal_each_group_on_its_own():
    rewards = torch.tensor([1.0, 0.0, 3.0, 2.0, 2.0, 5.0])
    groups = torch.tensor([0, 1, 0, 1, 1, 2])  # sizes 2, 3, 1, interleaved
    advantages, zero_std = group_advantages(rewards, groups)
    # group 0: {1, 3}, mean 2, population std 1; group 1: {0, 2, 2}, mean 4/3, std sqrt(8/9); group 2 alone
    s1 = math.sqrt(8 / 9)
    expected = [
        -1 / (1 + 1e-6),
        (0 - 4 / 3) / (s1 + 1e-6),
        1 / (1 + 1e-6),
        (2 / 3) / (s1 + 1e-6),
        (2 / 3) / (s1 + 1e-6),
        0.0,
    ]
    torch.testing.assert_close(advantages, torch.tensor(expected))
    assert zero_std.tolist() == [False, False, True]
    # the same as group_size with the groups laid out adjacently
    adjacent, _ = group_advantages(torch.tensor([1.0, 3.0, 0.0, 2.0, 2.0, 2.0, 1.0, 0.0]), 2)
    by_ids, _ = group_advantages(torch.tensor([1.0, 3.0, 0.0, 2.0, 2.0, 2.0, 1.0, 0.0]), torch.arange(8) // 2)
    assert torch.equal(adjacent, by_ids)


def test_per_turn_returns_use_the_mean_total_as_baseline_and_all_returns_for_the_std():
    nan = float("nan")
    # two samples of one group; returns-to-go per turn, column 0 the total; sample 1 has one turn
    returns = torch.tensor([[3.0, 1.0], [1.0, nan]])
    advantages, zero_std = group_advantages(returns, 2)
    baseline = (3.0 + 1.0) / 2
    values = torch.tensor([3.0, 1.0, 1.0])
    std = float(((values - values.mean()) ** 2).mean().sqrt())  # population std of every return: sqrt(8/9)
    assert abs(std - math.sqrt(8 / 9)) < 1e-6  # fp32 std of 3 exact values: a few roundings, <= 3e-7
    expected = torch.tensor(
        [[(3 - baseline) / (std + 1e-6), (1 - baseline) / (std + 1e-6)], [(1 - baseline) / (std + 1e-6), nan]]
    )
    torch.testing.assert_close(advantages, expected, equal_nan=True)
    assert zero_std.tolist() == [False]
    # a group whose every return is equal has no signal: exactly zero
    flat, zero = group_advantages(torch.tensor([[2.0, 2.0], [2.0, nan]]), 2)
    assert flat[0].tolist() == [0.0, 0.0] and zero.tolist() == [True]
    with pytest.raises(ValueError, match="reward at sample index 1"):
        group_advantages(torch.tensor([[1.0, 0.0], [nan, 1.0]]), 2)
