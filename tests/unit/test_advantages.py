"""GRPO advantages against values worked out by hand."""

from __future__ import annotations

import math

import pytest

from trainer.advantages import grpo_advantages

EPS = 1e-6


def test_two_winners_two_losers() -> None:
    # mean 0.5, population std 0.5
    a = grpo_advantages([1.0, 0.0, 0.0, 1.0], ["g"] * 4)
    s = 0.5 / (0.5 + EPS)
    assert a == pytest.approx([s, -s, -s, s], abs=1e-12)


def test_three_rewards_population_std() -> None:
    # mean 0.5; deviations 0, 0.5, -0.5; population std sqrt(0.5 / 3) (divide by G, not G-1)
    a = grpo_advantages([0.5, 1.0, 0.0], ["g"] * 3)
    std = math.sqrt(0.5 / 3)
    assert a == pytest.approx([0.0, 0.5 / (std + EPS), -0.5 / (std + EPS)], abs=1e-12)
    assert a[1] == pytest.approx(1.2247, abs=1e-4)


def test_interleaved_groups_are_normalised_separately() -> None:
    rewards = [1.0, 0.5, 0.0, 1.0, 3.0]
    groups = ["a", "b", "a", "b", "c"]
    a = grpo_advantages(rewards, groups)
    # a: [1, 0] -> +-0.5/0.5; b: [0.5, 1.0] -> mean 0.75, std 0.25 -> -+0.25/0.25; c alone -> 0
    sa, sb = 0.5 / (0.5 + EPS), 0.25 / (0.25 + EPS)
    assert a == pytest.approx([sa, -sb, -sa, sb, 0.0], abs=1e-12)


def test_order_of_episodes_does_not_matter() -> None:
    rewards = [0.2, 0.9, 0.4, 0.1, 0.7, 0.3]
    groups = ["x", "y", "x", "y", "x", "y"]
    base = grpo_advantages(rewards, groups)
    perm = [5, 2, 0, 4, 1, 3]
    shuffled = grpo_advantages([rewards[i] for i in perm], [groups[i] for i in perm])
    assert shuffled == pytest.approx([base[i] for i in perm], abs=1e-12)


def test_each_group_has_zero_mean_and_unit_std() -> None:
    rewards = [0.3, 2.0, -1.0, 0.7, 5.0, 5.5, 4.0]
    groups = ["a", "a", "a", "a", "b", "b", "b"]
    a = grpo_advantages(rewards, groups, eps=0.0)
    for g in ("a", "b"):
        vals = [x for x, gid in zip(a, groups, strict=True) if gid == g]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
        assert mean == pytest.approx(0.0, abs=1e-12)
        assert std == pytest.approx(1.0, abs=1e-12)


def test_zero_variance_group_gives_zeros() -> None:
    a = grpo_advantages([1.0, 1.0, 1.0, 1.0, 0.0], ["same"] * 3 + ["mixed"] * 2)
    assert a[:3] == [0.0, 0.0, 0.0]
    assert a[3] == pytest.approx(1.0, abs=1e-5)
    assert a[4] == pytest.approx(-1.0, abs=1e-5)


def test_zero_variance_group_with_inexact_mean_stays_near_zero() -> None:
    # mean(0.7, 0.7, 0.7) is not exactly 0.7 in floating point; eps keeps the result tiny.
    a = grpo_advantages([0.7, 0.7, 0.7], ["g"] * 3)
    assert a == pytest.approx([0.0, 0.0, 0.0], abs=1e-9)


def test_without_std_normalisation_only_centres() -> None:
    a = grpo_advantages([1.0, 0.0, 0.0, 1.0], ["g"] * 4, normalize_std=False)
    assert a == pytest.approx([0.5, -0.5, -0.5, 0.5], abs=1e-12)
    b = grpo_advantages([3.0, 1.0, 2.0], ["g"] * 3, normalize_std=False)
    assert b == pytest.approx([1.0, -1.0, 0.0], abs=1e-12)


def test_length_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="length"):
        grpo_advantages([1.0, 0.0], ["g"])


def test_empty_input() -> None:
    assert grpo_advantages([], []) == []
