"""GRPO group-normalised advantages.

For a group of G episodes with rewards r_1..r_G (same task, same policy):

    A_i = (r_i - mean(r)) / (std(r) + eps)

`std` is the population standard deviation (divide by G), as in the GRPO
paper (Shao et al., 2024, "DeepSeekMath"). A zero-variance group gives every
member exactly A = 0 (by `zero_variance_groups`, the scheduler skips such
groups before they reach here, or they train with zero advantage and the
engine does not forward them). Every token an episode sampled gets its episode's advantage.
"""

from __future__ import annotations

from collections import defaultdict

import torch


def grpo_advantage(
    value: float, group_returns: list[float], eps: float = 1e-6, normalize_std: bool = True
) -> float:
    """(value - mean) / (std + eps) with the group's statistics (population std).

    `value` may be a turn's own return (see trainer.returns); for a
    single-turn episode it is the episode's return, one of `group_returns`.
    """
    if all(x == value for x in group_returns):
        return 0.0  # a zero-variance group: exactly 0, not the rounding error of its mean
    r = torch.tensor(group_returns, dtype=torch.float64)
    centred = value - float(r.mean())
    if normalize_std:
        centred /= float(r.std(unbiased=False)) + eps
    return centred


def group_advantage(value: float, group_returns: list[float], estimator: str, eps: float) -> float:
    """The advantage of one return within its group, by `RunConfig.advantage_estimator`.

    - grpo:   (G - mean) / (std + eps)                       (Shao et al., 2024)
    - drgrpo: G - mean, no std division                       (Liu et al., 2025, Dr.GRPO)
    - rloo:   G - mean of the OTHER returns = n/(n-1) (G - mean)   (Ahmadian et al., 2024)
    """
    if estimator == "grpo":
        return grpo_advantage(value, group_returns, eps)
    if estimator == "drgrpo":
        return grpo_advantage(value, group_returns, eps, normalize_std=False)
    if estimator == "rloo":
        n = len(group_returns)
        if n < 2:
            return 0.0
        return n / (n - 1) * grpo_advantage(value, group_returns, eps, normalize_std=False)
    raise ValueError(f"unknown advantage_estimator {estimator!r}: grpo, drgrpo or rloo")


def grpo_advantages(
    rewards: list[float], group_ids: list[str], eps: float = 1e-6, normalize_std: bool = True
) -> list[float]:
    """One advantage per episode, normalised within its group."""
    if len(rewards) != len(group_ids):
        raise ValueError("rewards and group_ids differ in length")
    members: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    out = [0.0] * len(rewards)
    for idx in members.values():
        group = [rewards[i] for i in idx]
        for i in idx:
            out[i] = grpo_advantage(rewards[i], group, eps, normalize_std)
    return out
