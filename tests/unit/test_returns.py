"""Reward policies on conversation trees, against hand-computed returns."""

from __future__ import annotations

import pytest

from trainer.returns import Node, completion_returns, episode_outcome, episode_return

# root ── a ── a1      (a1 rewarded 1.0)
#     │     └─ a2      (a2 rewarded 0.0)
#     └─ b             (b rewarded 0.5)
TREE = [
    Node("root", None, None),
    Node("a", "root", None),
    Node("a1", "a", 1.0),
    Node("a2", "a", 0.0),
    Node("b", "root", 0.5),
]


def test_discounted_returns_follow_each_branch() -> None:
    g = completion_returns(TREE, episode_reward=None, policy="discounted", gamma=0.5)
    # leaves: own reward (no episode reward)
    assert g["a1"] == 1.0 and g["a2"] == 0.0 and g["b"] == 0.5
    # a: 0 + 0.5 * mean(1.0, 0.0) = 0.25 ; root: 0 + 0.5 * mean(0.25, 0.5) = 0.1875
    assert g["a"] == pytest.approx(0.25)
    assert g["root"] == pytest.approx(0.1875)


def test_siblings_do_not_leak_into_each_other() -> None:
    base = completion_returns(TREE, None, "discounted", 0.5)
    louder = [Node(n.id, n.parent_id, 10.0 if n.id == "b" else n.reward) for n in TREE]
    changed = completion_returns(louder, None, "discounted", 0.5)
    # b's reward reaches only b and its ancestors, never the a-branch
    assert changed["a"] == base["a"] and changed["a1"] == base["a1"]
    assert changed["b"] == 10.0
    assert changed["root"] == pytest.approx(0.5 * (0.25 + 10.0) / 2)


def test_episode_reward_lands_on_every_leaf_when_discounting() -> None:
    chain = [Node("t0", None, None), Node("t1", "t0", 0.2), Node("t2", "t1", None)]
    g = completion_returns(chain, episode_reward=1.0, policy="discounted", gamma=0.9)
    assert g["t2"] == pytest.approx(1.0)
    assert g["t1"] == pytest.approx(0.2 + 0.9 * 1.0)
    assert g["t0"] == pytest.approx(0.9 * (0.2 + 0.9))
    assert episode_return(chain, 1.0, "discounted", 0.9) == pytest.approx(g["t0"])


def test_broadcast_and_terminal() -> None:
    assert episode_outcome(TREE, None) == pytest.approx(1.5)  # sum of per-turn rewards
    assert set(completion_returns(TREE, 2.0, "broadcast").values()) == {2.0}
    g = completion_returns(TREE, 2.0, "terminal")
    assert {k for k, v in g.items() if v is not None} == {"a1", "a2", "b"}
    assert g["a1"] == 2.0 and g["root"] is None and g["a"] is None


def test_gamma_one_discounted_equals_broadcast_for_a_chain() -> None:
    chain = [Node("t0", None, None), Node("t1", "t0", None)]
    d = completion_returns(chain, 0.7, "discounted", 1.0)
    b = completion_returns(chain, 0.7, "broadcast")
    assert d == pytest.approx(b)


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="reward_policy"):
        completion_returns(TREE, 1.0, "nope")  # type: ignore[arg-type]


def test_worked_example_from_the_docs() -> None:
    """docs/rewards.md, "Worked example": the numbers there are these numbers."""
    from trainer.advantages import grpo_advantage

    a = [Node("a0", None, None), Node("a1", "a0", 1.0), Node("a2", "a0", 0.0)]
    b = [Node("b0", None, None)]
    ga = completion_returns(a, None, "discounted", 0.5)
    gb = completion_returns(b, 0.5, "discounted", 0.5)
    assert ga == pytest.approx({"a0": 0.25, "a1": 1.0, "a2": 0.0})
    assert gb == pytest.approx({"b0": 0.5})
    group = [episode_return(a, None, "discounted", 0.5), episode_return(b, 0.5, "discounted", 0.5)]
    assert group == pytest.approx([0.25, 0.5])
    adv = {k: grpo_advantage(v, group, eps=0.0) for k, v in {**ga, **gb}.items()}
    assert adv == pytest.approx({"a0": -1.0, "a1": 5.0, "a2": -3.0, "b0": 1.0})
