"""How rewards become per-completion returns, and returns become advantages.

An episode is a tree of completions (a turn's parent is the completion whose
messages plus answer begin the turn's messages). Rewards arrive per episode
(R) and/or per completion (r_c, default 0). Three policies, set by
`RunConfig.reward_policy`:

- ``broadcast`` (default): every completion's return is the episode outcome
  G_c = R_e, where R_e is the episode reward, or, without one, the sum of
  the per-turn rewards. Multi-turn GRPO as usually run.
- ``terminal``: only the final turn of each branch (a leaf) carries the
  outcome, G_leaf = R_e; earlier turns get no advantage (their tokens are
  context, not trained toward anything).
- ``discounted``: returns along each branch of the tree,
  G_c = r_c + gamma * mean(G_child for child of c), and a leaf gets
  G_leaf = r_leaf + R (the explicit episode reward lands on the last turn
  of every branch). A node with several children averages their returns, so
  siblings never leak into each other's returns: a branch's reward reaches
  only its own ancestors.

Advantages (GRPO): A_c = (G_c - mean_g) / (std_g + eps), where mean_g and
std_g (population) are taken over the group's episode returns: R_e for
broadcast and terminal, the mean return of the episode's root turns for
discounted (equal to R_e when gamma is 1 and rewards are episode-level).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

RewardPolicy = Literal["broadcast", "terminal", "discounted"]


@dataclass(frozen=True)
class Node:
    id: str
    parent_id: str | None
    reward: float | None  # per-turn reward, if one was posted


def episode_outcome(nodes: list[Node], episode_reward: float | None) -> float:
    """R_e: the episode reward, or the sum of per-turn rewards without one."""
    if episode_reward is not None:
        return float(episode_reward)
    return float(sum(n.reward or 0.0 for n in nodes))


def completion_returns(
    nodes: list[Node],
    episode_reward: float | None,
    policy: RewardPolicy = "broadcast",
    gamma: float = 1.0,
) -> dict[str, float | None]:
    """G_c per completion id; None means "not trained toward anything" (terminal, non-leaf)."""
    ids = {n.id for n in nodes}
    children: dict[str, list[str]] = defaultdict(list)
    for n in nodes:
        if n.parent_id in ids:
            children[n.parent_id].append(n.id)
    outcome = episode_outcome(nodes, episode_reward)
    if policy == "broadcast":
        return {n.id: outcome for n in nodes}
    if policy == "terminal":
        return {n.id: (outcome if not children[n.id] else None) for n in nodes}
    if policy != "discounted":
        raise ValueError(f"unknown reward_policy {policy!r}: broadcast, terminal or discounted")
    by_id = {n.id: n for n in nodes}
    memo: dict[str, float] = {}

    def ret(node_id: str) -> float:
        if node_id not in memo:
            node = by_id[node_id]
            own = node.reward or 0.0
            kids = children[node_id]
            if kids:
                memo[node_id] = own + gamma * statistics.fmean(ret(k) for k in kids)
            else:
                memo[node_id] = own + (episode_reward or 0.0)
        return memo[node_id]

    return {n.id: ret(n.id) for n in nodes}


def episode_return(
    nodes: list[Node], episode_reward: float | None, policy: RewardPolicy, gamma: float
) -> float:
    """The number GRPO normalises within a group (see the module docstring)."""
    if policy != "discounted":
        return episode_outcome(nodes, episode_reward)
    returns = completion_returns(nodes, episode_reward, policy, gamma)
    ids = {n.id for n in nodes}
    roots = [n.id for n in nodes if n.parent_id not in ids]
    return statistics.fmean(returns[r] or 0.0 for r in roots)  # discounted: never None
