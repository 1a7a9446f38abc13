"""`trainer.submit.preview_advantages`: the group view's numbers, from the trainer's functions."""

from __future__ import annotations

import pytest

from core.store.models import Completion, Episode
from core.store.status import EpisodeStatus
from trainer.config import RunConfig
from trainer.submit import preview_advantages


def _ep(eid: str, reward: float | None, status: str = EpisodeStatus.REWARDED, step=None) -> Episode:
    return Episode(run_id="r", id=eid, group_id="g", reward=reward, status=status, train_step=step)


def _turn(cid: str, eid: str, finish_reason: str = "stop") -> Completion:
    return Completion(id=cid, episode_id=eid, parent_id=None, finish_reason=finish_reason)


def test_members_are_normalised_with_their_peers_and_cancelled_turns_get_nothing() -> None:
    cfg = RunConfig(group_size=2, groups_per_step=1)
    episodes = [
        _ep("a", 1.0),
        _ep("b", 0.0),
        _ep("dropped", 5.0, EpisodeStatus.DROPPED),
        _ep("open", None, EpisodeStatus.OPEN),
    ]
    turns = {
        "a": [_turn("a1", "a"), _turn("a2", "a", "cancelled")],
        "b": [_turn("b1", "b")],
        "dropped": [_turn("d1", "dropped")],
    }
    out = preview_advantages(cfg, episodes, turns, {"a": 1.0, "b": 0.0, "dropped": 5.0})
    a, b = out["a"], out["b"]
    assert (a.episode_return, b.episode_return) == (1.0, 0.0)
    assert (a.peers, b.peers) == (2, 2)
    assert a.advantage == pytest.approx(1.0, abs=1e-4)
    assert b.advantage == pytest.approx(-1.0, abs=1e-4)
    assert a.turn_returns == {"a1": 1.0, "a2": None}
    assert a.turn_advantages["a1"] == pytest.approx(1.0, abs=1e-4)
    assert a.turn_advantages["a2"] is None
    for left_out in ("dropped", "open"):
        p = out[left_out]
        assert (p.episode_return, p.advantage, p.peers) == (None, None, 0)
    assert out["dropped"].turn_advantages == {"d1": None}
    assert out["open"].turn_returns == {}
