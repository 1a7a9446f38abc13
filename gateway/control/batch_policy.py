"""Which episodes train next: the batch-selection policy, a pure function of a run's snapshot.

The scheduler reads the snapshot (`core.store.episodes.batch_snapshot`),
calls `select_batch`, and has the store apply the returned `BatchDecision`
(`core.store.episodes.apply_batch_decision`). Nothing here touches the
database, so each rule below is unit-tested on plain values
(tests/unit/test_batch_policy.py).

The rules, in the order they apply:

1. Expired: an open (unrewarded) episode whose last call, or without
   calls its creation, is more than `episode_timeout_s` ago; it never trains.
2. Groups: episodes sharing a group id form a group. Ungrouped episodes
   (`UNGROUPED`) did not say which task they attempted; their rewarded ones
   are pooled oldest first into chunks of `group_size` (a leftover short
   chunk waits for more), so a chunk's mean is a batch baseline rather than
   GRPO's same-task baseline. A chosen chunk is renamed `~pool-<first id>`
   and is a group of its own from then on.
3. Groups are judged oldest first (by their oldest episode):
   - incomplete (short of `group_size`, or with open episodes): waits until
     `group_timeout_s` after it started; then, by `incomplete_groups`, its
     rewarded episodes train (if at least two) or are dropped;
   - stale: if any completion of any member was sampled more than
     `max_staleness` versions before the current one, the group is dropped.
     A completion's version is its oldest token's (`policy_version`): a
     generation kept across several keep-mode swaps finishes normally, and
     if its first tokens are more than `max_staleness` versions old by the
     time it is judged, its group is dropped and counted like any stale drop;
   - zero variance: all rewards equal gives every token zero advantage; by
     `zero_variance_groups` the group is ready like any other ("train", the
     default: it takes its place in the step with zero advantage, as in TRL's
     GRPOTrainer, so there is one optimizer step per `groups_per_step` groups
     sampled and an agent that sends a fixed batch of groups always sees the
     step happen; the engine does not forward it) or is dropped ("skip");
   - otherwise it is ready.
4. With fewer than `groups_per_step` ready groups nothing trains (the
   expiries and drops above still stand); otherwise the first
   `groups_per_step` ready groups are chosen.

Every group gets a `Verdict`, so a step can report what happened to each;
what is dropped is also counted in the run's counters (`BatchDecision.counters`).
How many ready groups a step takes is decided in `_choose` alone, and what a
zero-variance group does in one branch of `_judge`.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from datetime import datetime, timedelta
from enum import StrEnum
from typing import TYPE_CHECKING, Literal

from core.store.status import UNGROUPED, EpisodeStatus

if TYPE_CHECKING:
    from core.store.episodes import EpisodeSnapshot
    from trainer.config import RunConfig

POOL_PREFIX = "~pool-"  # the group id of a chosen pool chunk: POOL_PREFIX + its first episode id


@dataclass(frozen=True)
class BatchConfig:
    """The run's knobs that decide which episodes train (a slice of `RunConfig`)."""

    group_size: int  # episodes per GRPO group
    groups_per_step: int  # groups in one step; fewer ready groups means no step yet
    max_staleness: int  # samples older than current_version - max_staleness drop their group
    episode_timeout_s: float  # an open episode idle this long expires
    group_timeout_s: float  # a group still incomplete this long after it started is judged
    incomplete_groups: Literal["train", "drop"]  # what a timed-out group's rewarded episodes do
    zero_variance_groups: Literal["skip", "train"] = "train"  # equal rewards: trained or dropped

    @classmethod
    def from_run_config(cls, cfg: RunConfig) -> BatchConfig:
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})


class Verdict(StrEnum):
    """What the policy decided for one group."""

    WAITING = "waiting"  # incomplete and within group_timeout_s: left as it is
    INCOMPLETE = "dropped_incomplete"  # timed out and not trainable: its rewarded ones dropped
    STALE = "stale"  # a member sampled by a version too old: all members dropped
    ZERO_VARIANCE = "skipped_zero_variance"  # equal rewards, nothing to learn: dropped
    READY = "ready"  # could train, but not in this step
    CHOSEN = "chosen"  # trains in this step


DROPPING = frozenset({Verdict.INCOMPLETE, Verdict.STALE, Verdict.ZERO_VARIANCE})


@dataclass(frozen=True)
class GroupDecision:
    """One candidate group and its verdict."""

    group_id: str  # as stored (`UNGROUPED` for a pool chunk)
    episode_ids: tuple[str, ...]  # the members the verdict applies to, in snapshot order
    verdict: Verdict
    pooled: bool = False  # a chunk of ungrouped episodes
    short: bool = False  # ready or chosen with fewer than group_size members (timed out)

    @property
    def train_group_id(self) -> str:
        """The group id it trains under: a pool chunk is named after its first episode."""
        if self.pooled:
            return f"{POOL_PREFIX}{self.episode_ids[0]}"[:100]  # episodes.group_id is 100 wide
        return self.group_id


@dataclass(frozen=True)
class BatchDecision:
    """The policy's answer: what to train, and what to mark and count on the way."""

    expired: tuple[str, ...] = ()  # episode ids to mark expired
    groups: tuple[GroupDecision, ...] = ()  # every judged group, oldest first
    counters: dict[str, int] = field(default_factory=dict)  # run counter -> increment
    # the first moment the clock alone changes a verdict (an open episode expires, a waiting
    # group times out); None: nothing here changes by time. New rewards, a new version or
    # a new episode joining a group change a decision too, and are not counted here.
    next_change: datetime | None = None

    @property
    def chosen(self) -> list[GroupDecision]:
        return [g for g in self.groups if g.verdict is Verdict.CHOSEN]

    @property
    def episode_ids(self) -> list[str]:
        """The episodes of this step (empty: no step yet)."""
        return [e for g in self.chosen for e in g.episode_ids]

    @property
    def dropped(self) -> list[tuple[str, Verdict]]:
        """(episode id, reason) for each episode to mark dropped."""
        return [(e, g.verdict) for g in self.groups if g.verdict in DROPPING for e in g.episode_ids]

    @property
    def regrouped(self) -> dict[str, str]:
        """Episode id -> new group id, for the chosen pool chunks."""
        return {e: g.train_group_id for g in self.chosen if g.pooled for e in g.episode_ids}


def select_batch(
    episodes: Sequence[EpisodeSnapshot], current_version: int, now: datetime, cfg: BatchConfig
) -> BatchDecision:
    """Judge a run's open and rewarded episodes (see the module docstring for the rules).

    `now` and every time in the snapshot are timezone-aware UTC. Groups that
    started at the same time keep the order they first appear in `episodes`.
    """
    expired: list[str] = []
    groups: dict[str, list[EpisodeSnapshot]] = defaultdict(list)
    changes: list[datetime] = []  # when the clock alone would change a verdict
    for ep in episodes:
        last = ep.last_call_at or ep.created_at
        if ep.status == EpisodeStatus.OPEN and (now - last).total_seconds() > cfg.episode_timeout_s:
            expired.append(ep.id)
            continue
        if ep.status == EpisodeStatus.OPEN:
            changes.append(last + timedelta(seconds=cfg.episode_timeout_s))
        groups[ep.group_id].append(ep)
    counters: dict[str, int] = {}
    _bump(counters, "expired_episodes", len(expired))

    candidates = [(m, False) for g, m in groups.items() if g != UNGROUPED]
    candidates += [(m, True) for m in _pool_chunks(groups.get(UNGROUPED, []), cfg.group_size)]
    candidates.sort(key=lambda c: min(e.created_at for e in c[0]))  # stable: ties keep order
    judged: list[GroupDecision] = []
    for members, pooled in candidates:
        verdict, judged_members = _judge(members, current_version, now, cfg)
        if verdict is Verdict.WAITING:
            started = min(e.created_at for e in members)
            changes.append(started + timedelta(seconds=cfg.group_timeout_s))
        judged.append(
            GroupDecision(
                group_id=members[0].group_id,
                episode_ids=tuple(e.id for e in judged_members),
                verdict=verdict,
                pooled=pooled,
                short=verdict is Verdict.READY and len(judged_members) < cfg.group_size,
            )
        )
        if verdict is Verdict.INCOMPLETE:  # counted once per group that had rewards to drop
            _bump(counters, "dropped_incomplete_groups", 1 if judged_members else 0)
        elif verdict is Verdict.STALE:  # counted per episode
            _bump(counters, "dropped_stale_episodes", len(judged_members))
        elif verdict is Verdict.ZERO_VARIANCE:  # counted per group
            _bump(counters, "skipped_zero_variance_groups", 1)

    judged = _choose(judged, cfg)
    chosen_short = sum(1 for g in judged if g.verdict is Verdict.CHOSEN and g.short)
    _bump(counters, "trained_incomplete_groups", chosen_short)
    return BatchDecision(
        expired=tuple(expired),
        groups=tuple(judged),
        counters=counters,
        next_change=min(changes, default=None),
    )


def _reward(e: EpisodeSnapshot) -> float:
    if e.reward is None:  # a rewarded episode always has one (`refresh_episode_status`)
        raise ValueError(f"episode {e.id!r} is rewarded without a reward")
    return float(e.reward)


def _judge(
    members: list[EpisodeSnapshot], current_version: int, now: datetime, cfg: BatchConfig
) -> tuple[Verdict, list[EpisodeSnapshot]]:
    """A group's verdict and the members it applies to (a timed-out group: its rewarded ones)."""
    rewarded = [e for e in members if e.status == EpisodeStatus.REWARDED]
    if len(members) < cfg.group_size or len(rewarded) < len(members):
        started = min(e.created_at for e in members)
        if (now - started).total_seconds() <= cfg.group_timeout_s:
            return Verdict.WAITING, members  # still filling up
        if cfg.incomplete_groups == "drop" or len(rewarded) < 2:
            return Verdict.INCOMPLETE, rewarded  # its open episodes stay open (they may expire)
        members = rewarded
    floor = current_version - cfg.max_staleness
    # An episode without completions was sampled by nobody: never stale.
    if any(
        (e.oldest_version if e.oldest_version is not None else current_version) < floor
        for e in members
    ):
        return Verdict.STALE, members
    if (
        cfg.zero_variance_groups == "skip"
        and statistics.pstdev([_reward(e) for e in members]) == 0.0
    ):
        return Verdict.ZERO_VARIANCE, members
    return Verdict.READY, members


def _choose(judged: list[GroupDecision], cfg: BatchConfig) -> list[GroupDecision]:
    """The first `groups_per_step` ready groups train, or none if fewer are ready."""
    ready = [i for i, g in enumerate(judged) if g.verdict is Verdict.READY]
    if len(ready) < cfg.groups_per_step:
        return judged
    chosen = set(ready[: cfg.groups_per_step])
    return [replace(g, verdict=Verdict.CHOSEN) if i in chosen else g for i, g in enumerate(judged)]


def _pool_chunks(pool: list[EpisodeSnapshot], size: int) -> list[list[EpisodeSnapshot]]:
    """Rewarded ungrouped episodes, oldest first, in chunks of `size`; a short rest waits.

    Such episodes did not say which task they attempted, so a chunk's mean
    is a batch baseline rather than GRPO's same-task baseline; it still lets
    them train instead of waiting forever for group-mates.
    """
    rewarded = sorted(
        (e for e in pool if e.status == EpisodeStatus.REWARDED), key=lambda e: e.created_at
    )
    return [rewarded[i : i + size] for i in range(0, len(rewarded) - size + 1, size)]


def _bump(counters: dict[str, int], name: str, by: int) -> None:
    if by:  # a counter appears once something was counted in it
        counters[name] = counters.get(name, 0) + by
