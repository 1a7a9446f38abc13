"""The batch-selection policy on plain snapshots: no database, every expectation worked by hand.

Unless a test says otherwise: group_size 2, one group per step, current
version 5 with max_staleness 1 (so versions below 4 are stale), episodes
expire after 100 s idle and groups are judged 50 s after they started.
"""

from __future__ import annotations

from dataclasses import fields, replace
from datetime import UTC, datetime, timedelta

from core.store.episodes import EpisodeSnapshot
from core.store.status import UNGROUPED, EpisodeStatus
from gateway.control.batch_policy import BatchConfig, Verdict, select_batch
from inference.types import result_with_marks
from trainer.config import RunConfig

NOW = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
VERSION = 5
CFG = BatchConfig(
    group_size=2,
    groups_per_step=1,
    max_staleness=1,
    episode_timeout_s=100.0,
    group_timeout_s=50.0,
    incomplete_groups="train",
    zero_variance_groups="skip",  # the tests of skipping; "train" ones replace() it
)


def ep(
    eid: str,
    group: str = "g",
    *,
    status: EpisodeStatus = EpisodeStatus.REWARDED,
    reward: float | None = None,
    age: float = 10.0,
    idle: float | None = None,
    version: int | None = VERSION,
) -> EpisodeSnapshot:
    """An episode created `age` s ago whose last call was `idle` s ago (None: no call)."""
    if reward is None and status == EpisodeStatus.REWARDED:
        reward = 1.0
    return EpisodeSnapshot(
        id=eid,
        group_id=group,
        status=status,
        reward=reward,
        created_at=NOW - timedelta(seconds=age),
        last_call_at=None if idle is None else NOW - timedelta(seconds=idle),
        oldest_version=version,
    )


def open_ep(eid: str, group: str = "g", **kw) -> EpisodeSnapshot:
    return ep(eid, group, status=EpisodeStatus.OPEN, **kw)


def timed_out_group() -> list[EpisodeSnapshot]:
    """Group g, started 60 s ago: two rewarded episodes and one still open (and not idle)."""
    return [
        ep("a", reward=1.0, age=60),
        ep("b", reward=0.0, age=55),
        open_ep("c", age=55, idle=10),
    ]


def verdicts(decision) -> list[tuple[str, tuple[str, ...], Verdict]]:
    return [(g.group_id, g.episode_ids, g.verdict) for g in decision.groups]


def test_batch_config_takes_its_fields_from_run_config() -> None:
    run_cfg = RunConfig(
        group_size=3, groups_per_step=2, micro_batch_size=6, incomplete_groups="drop"
    )
    cfg = BatchConfig.from_run_config(run_cfg)
    assert {f.name: getattr(cfg, f.name) for f in fields(cfg)} == {
        "group_size": 3,
        "groups_per_step": 2,
        "max_staleness": 1,
        "episode_timeout_s": 3600.0,
        "group_timeout_s": 600.0,
        "incomplete_groups": "drop",
        "zero_variance_groups": "train",
    }


def test_open_episodes_idle_past_the_timeout_expire() -> None:
    cfg = replace(CFG, group_timeout_s=1e9)  # keep groups waiting: only expiry is judged
    snapshot = [
        open_ep("a", "g1", age=500, idle=150),  # last call 150 s ago > 100: expires
        open_ep("b", "g2", age=500, idle=50),  # called 50 s ago: lives
        open_ep("c", "g3", age=101),  # no call, created 101 s ago: expires
        open_ep("d", "g4", age=100),  # exactly the timeout: not past it
        ep("e", "g5", reward=1.0, age=600, idle=600),  # rewarded: never expires
    ]
    decision = select_batch(snapshot, VERSION, NOW, cfg)
    assert decision.expired == ("a", "c")
    assert decision.counters == {"expired_episodes": 2}
    assert [g.group_id for g in decision.groups] == ["g5", "g2", "g4"]  # g1, g3 are gone
    assert all(g.verdict is Verdict.WAITING for g in decision.groups)
    assert decision.episode_ids == [] and decision.dropped == []


def test_a_timed_out_group_trains_its_rewarded_episodes_when_incomplete_groups_is_train() -> None:
    cfg = replace(CFG, group_size=3)
    decision = select_batch(timed_out_group(), VERSION, NOW, cfg)
    assert verdicts(decision) == [("g", ("a", "b"), Verdict.CHOSEN)]
    assert decision.episode_ids == ["a", "b"]  # the open one stays open, untouched
    assert decision.counters == {"trained_incomplete_groups": 1}
    assert decision.dropped == [] and decision.expired == ()
    assert decision.regrouped == {}


def test_an_incomplete_group_waits_until_its_timeout() -> None:
    cfg = replace(CFG, group_size=3)
    snapshot = [ep("a", reward=1.0, age=50), ep("b", reward=0.0, age=40)]  # 50 s: not past it
    decision = select_batch(snapshot, VERSION, NOW, cfg)
    assert verdicts(decision) == [("g", ("a", "b"), Verdict.WAITING)]
    assert decision.counters == {} and decision.episode_ids == [] and decision.dropped == []


def test_a_timed_out_group_is_dropped_when_incomplete_groups_is_drop() -> None:
    cfg = replace(CFG, group_size=3, incomplete_groups="drop")
    decision = select_batch(timed_out_group(), VERSION, NOW, cfg)
    assert verdicts(decision) == [("g", ("a", "b"), Verdict.INCOMPLETE)]
    assert decision.dropped == [("a", Verdict.INCOMPLETE), ("b", Verdict.INCOMPLETE)]
    assert decision.counters == {"dropped_incomplete_groups": 1}  # once per group
    assert decision.episode_ids == []


def test_a_timed_out_group_with_fewer_than_two_rewarded_is_dropped_even_in_train_mode() -> None:
    snapshot = [
        ep("a", "g", reward=1.0, age=60),
        open_ep("b", "g", age=60, idle=10),
        open_ep("c", "h", age=70, idle=10),  # nothing rewarded: nothing to drop or count
        open_ep("d", "h", age=70, idle=10),
    ]
    decision = select_batch(snapshot, VERSION, NOW, CFG)
    assert verdicts(decision) == [
        ("h", (), Verdict.INCOMPLETE),
        ("g", ("a",), Verdict.INCOMPLETE),
    ]
    assert decision.dropped == [("a", Verdict.INCOMPLETE)]
    assert decision.counters == {"dropped_incomplete_groups": 1}


def test_ungrouped_episodes_are_pooled_oldest_first_in_chunks_of_group_size() -> None:
    cfg = replace(CFG, groups_per_step=2)
    snapshot = [
        ep("u1", UNGROUPED, reward=1.0, age=30),
        ep("u2", UNGROUPED, reward=0.0, age=40),
        ep("u3", UNGROUPED, reward=1.0, age=20),
        open_ep("u4", UNGROUPED, age=50),  # open: never pooled
        ep("u5", UNGROUPED, reward=0.0, age=10),
    ]
    decision = select_batch(snapshot, VERSION, NOW, cfg)
    assert verdicts(decision) == [
        (UNGROUPED, ("u2", "u1"), Verdict.CHOSEN),
        (UNGROUPED, ("u3", "u5"), Verdict.CHOSEN),
    ]
    assert decision.regrouped == {
        "u2": "~pool-u2",
        "u1": "~pool-u2",
        "u3": "~pool-u3",
        "u5": "~pool-u3",
    }
    assert decision.counters == {}


def test_a_leftover_ungrouped_episode_waits_for_a_full_chunk() -> None:
    snapshot = [
        ep("u1", UNGROUPED, reward=1.0, age=30),
        ep("u2", UNGROUPED, reward=0.0, age=40),
        ep("u3", UNGROUPED, reward=1.0, age=900),  # oldest: pooled first, however old
    ]
    decision = select_batch(snapshot, VERSION, NOW, CFG)
    assert verdicts(decision) == [(UNGROUPED, ("u3", "u2"), Verdict.CHOSEN)]
    assert decision.regrouped == {"u3": "~pool-u3", "u2": "~pool-u3"}  # u1 waits, unjudged
    assert decision.dropped == [] and decision.counters == {}


def test_a_pool_chunk_that_does_not_train_keeps_the_ungrouped_id() -> None:
    snapshot = [
        ep("u1", UNGROUPED, reward=1.0, age=30),
        ep("u2", UNGROUPED, reward=1.0, age=40),
    ]
    decision = select_batch(snapshot, VERSION, NOW, CFG)
    assert verdicts(decision) == [(UNGROUPED, ("u2", "u1"), Verdict.ZERO_VARIANCE)]
    assert decision.regrouped == {}


def test_a_zero_variance_group_is_skipped() -> None:
    snapshot = [
        ep("a", "g", reward=1.0, age=30),
        ep("b", "g", reward=1.0, age=20),
        ep("c", "h", reward=0.0, age=20),
        ep("d", "h", reward=1.0, age=10),
    ]
    decision = select_batch(snapshot, VERSION, NOW, CFG)
    assert verdicts(decision) == [
        ("g", ("a", "b"), Verdict.ZERO_VARIANCE),
        ("h", ("c", "d"), Verdict.CHOSEN),
    ]
    assert decision.dropped == [("a", Verdict.ZERO_VARIANCE), ("b", Verdict.ZERO_VARIANCE)]
    assert decision.counters == {"skipped_zero_variance_groups": 1}  # once per group


def test_one_stale_completion_drops_the_whole_group() -> None:
    snapshot = [
        ep("a", "g", reward=1.0, age=30, version=4),  # the floor itself (5 - 1): fresh enough
        ep("b", "g", reward=0.0, age=20, version=3),  # below the floor: stale
        ep("c", "h", reward=0.0, age=20, version=None),  # no completions: never stale
        ep("d", "h", reward=1.0, age=10, version=4),
    ]
    decision = select_batch(snapshot, VERSION, NOW, CFG)
    assert verdicts(decision) == [
        ("g", ("a", "b"), Verdict.STALE),
        ("h", ("c", "d"), Verdict.CHOSEN),
    ]
    assert decision.dropped == [("a", Verdict.STALE), ("b", Verdict.STALE)]
    assert decision.counters == {"dropped_stale_episodes": 2}  # per episode, not per group


def test_fewer_ready_groups_than_groups_per_step_choose_nothing_but_drops_stand() -> None:
    cfg = replace(CFG, group_size=3, groups_per_step=2)
    snapshot = [
        ep("a", "g", reward=1.0, age=60),  # timed out with two rewarded: ready, short
        ep("b", "g", reward=0.0, age=60),
        ep("c", "h", reward=1.0, age=20),  # complete but zero variance
        ep("d", "h", reward=1.0, age=20),
        ep("e", "h", reward=1.0, age=20),
    ]
    decision = select_batch(snapshot, VERSION, NOW, cfg)
    assert verdicts(decision) == [
        ("g", ("a", "b"), Verdict.READY),
        ("h", ("c", "d", "e"), Verdict.ZERO_VARIANCE),
    ]
    assert decision.chosen == [] and decision.episode_ids == []
    assert decision.counters == {"skipped_zero_variance_groups": 1}  # no trained_incomplete
    assert [e for e, _ in decision.dropped] == ["c", "d", "e"]


def test_groups_are_taken_in_order_of_their_oldest_episode() -> None:
    cfg = replace(CFG, groups_per_step=2)
    snapshot = [
        ep("l1", "late", reward=1.0, age=10),
        ep("l2", "late", reward=0.0, age=5),
        ep("m1", "mid", reward=1.0, age=20),
        ep("m2", "mid", reward=0.0, age=1),
        ep("e1", "early", reward=1.0, age=2),
        ep("e2", "early", reward=0.0, age=30),  # the oldest episode of all
    ]
    decision = select_batch(snapshot, VERSION, NOW, cfg)
    assert [(g.group_id, g.verdict) for g in decision.groups] == [
        ("early", Verdict.CHOSEN),
        ("mid", Verdict.CHOSEN),
        ("late", Verdict.READY),
    ]
    assert decision.episode_ids == ["e1", "e2", "m1", "m2"]  # members keep snapshot order


def test_a_group_larger_than_group_size_trains_whole() -> None:
    snapshot = [ep(f"x{i}", reward=float(i), age=10) for i in range(3)]
    decision = select_batch(snapshot, VERSION, NOW, CFG)
    assert decision.episode_ids == ["x0", "x1", "x2"]
    assert decision.counters == {}


def test_a_zero_variance_group_trains_when_zero_variance_groups_is_train() -> None:
    cfg = replace(CFG, groups_per_step=2, zero_variance_groups="train")
    snapshot = [
        ep("a", "g", reward=0.0, age=30),  # all-zero: nothing to learn, but it takes its place
        ep("b", "g", reward=0.0, age=20),
        ep("c", "h", reward=0.0, age=20),
        ep("d", "h", reward=1.0, age=10),
    ]
    decision = select_batch(snapshot, VERSION, NOW, cfg)
    assert verdicts(decision) == [
        ("g", ("a", "b"), Verdict.CHOSEN),
        ("h", ("c", "d"), Verdict.CHOSEN),
    ]
    assert decision.episode_ids == ["a", "b", "c", "d"]
    assert decision.dropped == [] and decision.counters == {}
    # the same batch under "skip" drops g, and h alone is short of groups_per_step
    skipped = select_batch(snapshot, VERSION, NOW, replace(cfg, zero_variance_groups="skip"))
    assert [(g.group_id, g.verdict) for g in skipped.groups] == [
        ("g", Verdict.ZERO_VARIANCE),
        ("h", Verdict.READY),
    ]


def test_zero_variance_groups_train_still_drops_a_stale_group() -> None:
    cfg = replace(CFG, zero_variance_groups="train")
    snapshot = [ep("a", "g", reward=0.0, version=3), ep("b", "g", reward=0.0)]
    decision = select_batch(snapshot, VERSION, NOW, cfg)
    assert verdicts(decision) == [("g", ("a", "b"), Verdict.STALE)]


def test_next_change_is_the_first_expiry_or_group_timeout_still_ahead() -> None:
    # The scheduler skips its full pass until then while nothing else changed.
    snapshot = [
        open_ep("a", "g1", age=500, idle=70),  # expires in 30 s
        ep("b", "g2", reward=1.0, age=30),  # g2 waits for its second member: judged in 20 s
        open_ep("c", "g3", age=20),  # expires in 80 s; g3 judged in 30 s
        ep("d", "g4", reward=1.0, age=60),  # g4 timed out already: its verdict is final
    ]
    decision = select_batch(snapshot, VERSION, NOW, CFG)
    assert decision.next_change == NOW + timedelta(seconds=20)
    assert select_batch(snapshot[:1], VERSION, NOW, CFG).next_change == NOW + timedelta(seconds=30)
    rewarded_only = [ep("e", "g5", age=60), ep("f", "g5", reward=0.0, age=60)]
    assert select_batch(rewarded_only, VERSION, NOW, CFG).next_change is None  # nothing timed


def test_a_generation_that_lived_through_more_than_max_staleness_swaps_drops_its_group() -> None:
    # Kept across three keep-mode swaps (versions 2 -> 5): it finished normally, and its
    # oldest token is 3 versions behind, past max_staleness (1). The store's snapshot takes
    # an episode's oldest version from its completions' policy_version, the first token's.
    spanning = result_with_marks([7] * 9, [-0.5] * 9, "stop", [(0, 2), (3, 3), (5, 4), (8, 5)])
    assert spanning.version_starts == ((0, 2), (3, 3), (5, 4), (8, 5))
    assert spanning.policy_version == 2  # not 5, the version of its last tokens
    within = result_with_marks([7] * 4, [-0.5] * 4, "stop", [(0, 4), (2, 5)])
    snapshot = [
        ep("a", "g", reward=1.0, age=30, version=spanning.policy_version),
        ep("b", "g", reward=0.0, age=25, version=VERSION),
        ep("c", "h", reward=0.0, age=20, version=within.policy_version),  # 4: at the floor
        ep("d", "h", reward=1.0, age=10, version=VERSION),
    ]
    decision = select_batch(snapshot, VERSION, NOW, CFG)
    assert verdicts(decision) == [
        ("g", ("a", "b"), Verdict.STALE),
        ("h", ("c", "d"), Verdict.CHOSEN),
    ]
    assert decision.counters == {"dropped_stale_episodes": 2}  # counted as any stale drop
