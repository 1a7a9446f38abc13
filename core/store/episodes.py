"""Episodes: the sampling side's counts and pages, and the status moves of a train step."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Insert,
    Update,
    and_,
    bindparam,
    case,
    exists,
    func,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from core.store.models import Completion, Episode, Reward, Run, as_utc
from core.store.rewards import episode_posts_of
from core.store.runs import bump_counter
from core.store.status import PENDING_EPISODE, UNCONSUMED_EPISODE, UNGROUPED, EpisodeStatus


async def unconsumed_by_group(session: AsyncSession, run_id: str) -> dict[str, int]:
    """Group id -> episodes a step may still take (open, rewarded or queued)."""
    stmt = (
        select(Episode.group_id, func.count())
        .where(Episode.run_id == run_id, Episode.status.in_(UNCONSUMED_EPISODE))
        .group_by(Episode.group_id)
    )
    return {g: int(n) for g, n in (await session.execute(stmt)).all()}


async def stored_episode_ids(session: AsyncSession, run_id: str, ids: list[str]) -> list[str]:
    """Those of `ids` that are stored episodes of the run."""
    if not ids:
        return []
    stmt = select(Episode.id).where(Episode.run_id == run_id, Episode.id.in_(ids))
    return list((await session.execute(stmt)).scalars())


async def episodes_with_groups(
    session: AsyncSession, run_id: str, episode_ids: set[str], group_ids: set[str]
) -> list[Episode]:
    """The run's episodes named in `episode_ids` and every member of the groups `group_ids`."""
    if not episode_ids and not group_ids:
        return []
    stmt = select(Episode).where(
        Episode.run_id == run_id,
        or_(Episode.id.in_(episode_ids), Episode.group_id.in_(group_ids)),
    )
    found = list((await session.execute(stmt)).scalars())
    more = {e.group_id for e in found if e.id in episode_ids} - group_ids - {UNGROUPED}
    if more:  # the groups of the episodes asked about
        stmt = select(Episode).where(Episode.run_id == run_id, Episode.group_id.in_(more))
        found += list((await session.execute(stmt)).scalars())
    return found


async def episodes_by_status(session: AsyncSession, run_id: str) -> dict[str, int]:
    stmt = (
        select(Episode.status, func.count())
        .where(Episode.run_id == run_id)
        .group_by(Episode.status)
    )
    return {str(k): int(v) for k, v in (await session.execute(stmt)).all()}


async def episode_counts(session: AsyncSession) -> dict[tuple[str, str], int]:
    """(run, status) -> episodes, over every run."""
    stmt = select(Episode.run_id, Episode.status, func.count()).group_by(
        Episode.run_id, Episode.status
    )
    return {(r, st): int(n) for r, st, n in (await session.execute(stmt)).all()}


EPISODE_KEYS = ("run_id", "id", "group_id", "status", "created_at", "held_out")  # a capture's


@functools.cache
def insert_episodes_stmt(dialect: str) -> Insert:
    """Insert an episode unless it is stored: one already stored, by an earlier turn or by
    another gateway process in a race, keeps its row (group and status untouched)."""
    stmt = (pg_insert if dialect == "postgresql" else sqlite_insert)(Episode.__table__)
    return stmt.on_conflict_do_nothing(index_elements=["run_id", "id"])


async def insert_episodes(session: AsyncSession, rows: list[dict[str, Any]]) -> None:
    """`insert_episodes_stmt` for each of `rows` (`EPISODE_KEYS`), one executemany, no read."""
    if not rows:
        return
    conn = await session.connection()
    await conn.execute(insert_episodes_stmt(conn.dialect.name), rows)


def _reopen(*which: Any) -> Update:
    """A rewarded episode with no episode-level reward, given a new turn, is open again:
    its rewards were per turn, so it was not over. `which`: the episodes' conditions."""
    ep, reward = Episode.__table__, Reward.__table__
    return (
        update(ep)
        .where(
            *which,
            ep.c.status == EpisodeStatus.REWARDED,
            ~exists().where(
                reward.c.run_id == ep.c.run_id,
                reward.c.episode_id == ep.c.id,
                reward.c.completion_id.is_(None),
            ),
        )
        .values(status=EpisodeStatus.OPEN, reward=None, rewarded_at=None)
    )


@functools.cache
def reopen_stmt() -> Update:
    """`_reopen` of the episode (`:key_run`, `:key_episode`), for an executemany."""
    ep = Episode.__table__
    return _reopen(ep.c.run_id == bindparam("key_run"), ep.c.id == bindparam("key_episode"))


def reopen_some_stmt(n: int) -> Update:
    """`_reopen` of `n` episodes in one statement: (`:r<i>_run`, `:r<i>_episode`), i < n."""
    ep = Episode.__table__
    keys = [tuple_(bindparam(f"r{i}_run"), bindparam(f"r{i}_episode")) for i in range(n)]
    return _reopen(tuple_(ep.c.run_id, ep.c.id).in_(keys))


async def reopen_rewarded(session: AsyncSession, keys: Iterable[tuple[str, str]]) -> None:
    """`reopen_stmt` for each (run id, episode id) of `keys`, in one executemany."""
    params = [{"key_run": run_id, "key_episode": ep_id} for run_id, ep_id in keys]
    if params:
        conn = await session.connection()
        await conn.execute(reopen_stmt(), params)


@dataclass(frozen=True)
class EpisodeFilter:
    """Which of a run's episodes a page holds; None: no restriction.

    `version`: some completion was sampled by that version; `min_version`: none was
    sampled by an older one. `length_min`/`length_max` bound the tokens sampled over all
    the episode's turns; `drift`: some turn (True) or no turn (False) had template drift;
    `held_out`: evaluation (True) or training (False) episodes only. The others are plain
    column bounds.
    """

    status: str | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    version: int | None = None
    min_version: int | None = None
    group_id: str | None = None
    length_min: int | None = None
    length_max: int | None = None
    drift: bool | None = None
    held_out: bool | None = None


async def episode_page(
    session: AsyncSession,
    run_id: str,
    filt: EpisodeFilter,
    *,
    limit: int,
    newest_first: bool = False,
    after: tuple[datetime, str] | None = None,
) -> list[Episode]:
    """One keyset page of the run's episodes that `filt` keeps, in `(created_at, id)` order;
    `after` is the `(created_at, id)` of the previous page's last episode."""
    stmt = select(Episode).where(Episode.run_id == run_id, *_episode_bounds(filt))
    if after is not None:
        created, last_id = after
        if newest_first:
            beyond = or_(
                Episode.created_at < created,
                and_(Episode.created_at == created, Episode.id < last_id),
            )
        else:
            beyond = or_(
                Episode.created_at > created,
                and_(Episode.created_at == created, Episode.id > last_id),
            )
        stmt = stmt.where(beyond)
    if newest_first:
        stmt = stmt.order_by(Episode.created_at.desc(), Episode.id.desc())
    else:
        stmt = stmt.order_by(Episode.created_at, Episode.id)
    return list((await session.execute(stmt.limit(limit))).scalars())


def _episode_bounds(f: EpisodeFilter) -> Iterator[ColumnElement[bool]]:
    if f.status is not None:
        yield Episode.status == f.status
    if f.held_out is not None:
        yield Episode.held_out.is_(f.held_out)
    if f.group_id is not None:
        yield Episode.group_id == f.group_id
    if f.length_min is not None:
        yield _sampled_bytes() >= 4 * f.length_min
    if f.length_max is not None:
        yield _sampled_bytes() <= 4 * f.length_max
    if f.drift is not None:
        drifted = _has_completion(Completion.drift.is_(True))
        yield drifted if f.drift else ~drifted
    if f.reward_min is not None:
        yield Episode.reward >= f.reward_min
    if f.reward_max is not None:
        yield Episode.reward <= f.reward_max
    if f.version is not None:
        yield _has_completion(Completion.policy_version == f.version)
    if f.min_version is not None:
        yield ~_has_completion(Completion.policy_version < f.min_version)


def _has_completion(condition) -> Any:
    return exists().where(
        Completion.run_id == Episode.run_id, Completion.episode_id == Episode.id, condition
    )


def _sampled_bytes() -> Any:
    """Bytes of sampled ids over the episode's turns: 4 per token (`IntArray` packs int32)."""
    return (
        select(func.coalesce(func.sum(func.length(Completion.output_token_ids)), 0))
        .where(Completion.run_id == Episode.run_id, Completion.episode_id == Episode.id)
        .scalar_subquery()
    )


async def episode_shapes(
    session: AsyncSession, run_id: str, episode_ids: list[str]
) -> dict[str, tuple[int, bool]]:
    """Episode -> (tokens sampled over its turns, whether any turn had template drift)."""
    if not episode_ids:
        return {}
    rows = await session.execute(
        select(
            Completion.episode_id,
            func.sum(func.length(Completion.output_token_ids)),
            func.max(case((Completion.drift.is_(True), 1), else_=0)),
        )
        .where(Completion.run_id == run_id, Completion.episode_id.in_(episode_ids))
        .group_by(Completion.episode_id)
    )
    return {ep: (int(n or 0) // 4, bool(d)) for ep, n, d in rows.all()}


async def group_members(session: AsyncSession, run_id: str, group_id: str) -> list[Episode]:
    """Every episode of the run's group, oldest first."""
    stmt = (
        select(Episode)
        .where(Episode.run_id == run_id, Episode.group_id == group_id)
        .order_by(Episode.created_at, Episode.id)
    )
    return list((await session.execute(stmt)).scalars())


async def episode_reward_posts(
    session: AsyncSession, run_id: str, episode_ids: list[str]
) -> dict[str, float]:
    """Episode -> its newest episode-level reward post (per-turn posts live on completions)."""
    if not episode_ids:
        return {}
    posts = episode_posts_of(await session.get(Run, run_id), run_id)
    stmt = (
        select(Reward.episode_id, Reward.value)
        .where(posts, Reward.episode_id.in_(episode_ids))
        .order_by(Reward.id)
    )
    rows = (await session.execute(stmt)).all()
    return {ep: float(v) for ep, v in rows if ep is not None}  # newest wins


async def refresh_episode_status(session: AsyncSession, ep: Episode) -> None:
    """An episode is ready ("rewarded") once it has an episode reward or all turns have one."""
    if ep.status != EpisodeStatus.OPEN:
        return
    stmt = select(Completion.reward).where(
        Completion.run_id == ep.run_id, Completion.episode_id == ep.id
    )
    rewards = (await session.execute(stmt)).scalars().all()
    given = [r for r in rewards if r is not None]
    if ep.reward is None and rewards and len(given) == len(rewards):
        ep.reward = float(sum(given))
    if ep.reward is not None:
        ep.status = EpisodeStatus.REWARDED
        ep.rewarded_at = datetime.now(UTC)


@dataclass(frozen=True)
class EpisodeSnapshot:
    """What the batch policy (`gateway.control.batch_policy`) knows of one pending episode."""

    id: str
    group_id: str
    status: EpisodeStatus  # open or rewarded
    reward: float | None
    created_at: datetime  # UTC-aware, like the two below
    last_call_at: datetime | None  # its newest completion; None: no call yet
    oldest_version: int | None  # the oldest policy version among its completions


async def batch_snapshot(session: AsyncSession, run_id: str) -> list[EpisodeSnapshot]:
    """The run's open and rewarded episodes, for the claim (call it under the claim's lock).

    One statement, so one consistent read, joined to the episodes' completions rather than
    naming every pending episode in an IN list: with thousands of open episodes that list
    was most of the scan's time, and the scan holds the claim's lock while it runs.
    """
    stmt = (
        select(
            Episode.id,
            Episode.group_id,
            Episode.status,
            Episode.reward,
            Episode.created_at,
            func.max(Completion.created_at),
            func.min(Completion.policy_version),
        )
        .outerjoin(
            Completion,
            and_(Completion.run_id == Episode.run_id, Completion.episode_id == Episode.id),
        )
        .where(Episode.run_id == run_id, Episode.status.in_(PENDING_EPISODE))
        .group_by(Episode.id, Episode.group_id, Episode.status, Episode.reward, Episode.created_at)
    )
    return [
        EpisodeSnapshot(
            id=ep_id,
            group_id=group_id,
            status=EpisodeStatus(status),
            reward=reward,
            created_at=as_utc(created_at),
            last_call_at=as_utc(last_call) if last_call is not None else None,
            oldest_version=oldest,
        )
        for ep_id, group_id, status, reward, created_at, last_call, oldest in (
            await session.execute(stmt)
        ).all()
    ]


async def apply_batch_decision(
    session: AsyncSession,
    run: Run,
    *,
    expired: Iterable[str],
    dropped: Iterable[tuple[str, str]],
    regrouped: Mapping[str, str],
    counters: Mapping[str, int],
) -> None:
    """Store what the batch policy decided: status moves, pool chunks' group ids, run counters.

    `dropped` is (episode id, verdict); the verdict is kept in `episodes.verdict` so an agent
    can learn why. Takes plain values (see `BatchDecision`) so that the store does not depend
    on the policy.
    """
    await _set_status(session, run.id, list(expired), EpisodeStatus.EXPIRED)
    by_reason: dict[str, list[str]] = {}
    for episode_id, reason in dropped:
        by_reason.setdefault(str(reason), []).append(episode_id)
    for reason, ids in by_reason.items():
        await _set_status(session, run.id, ids, EpisodeStatus.DROPPED, verdict=reason)
    for episode_id, group_id in regrouped.items():
        await session.execute(
            update(Episode)
            .where(Episode.run_id == run.id, Episode.id == episode_id)
            .values(group_id=group_id)
        )
    for name, by in counters.items():
        bump_counter(run, name, by)


async def _set_status(
    session: AsyncSession, run_id: str, ids: list[str], status: EpisodeStatus, **values: Any
) -> None:
    if ids:
        await session.execute(
            update(Episode)
            .where(Episode.run_id == run_id, Episode.id.in_(ids))
            .values(status=status, **values)
        )


async def mark_queued(
    session: AsyncSession, run_id: str, episode_ids: list[str], step: int, verdict: str = "chosen"
) -> None:
    await session.execute(
        update(Episode)
        .where(Episode.run_id == run_id, Episode.id.in_(episode_ids))
        .values(status=EpisodeStatus.QUEUED, train_step=step, verdict=verdict)
    )


def _step_episodes(run_id: str, step: int, **values: Any) -> Update:
    return (
        update(Episode).where(Episode.run_id == run_id, Episode.train_step == step).values(**values)
    )


def _released(run_id: str, step: int) -> Update:
    return _step_episodes(run_id, step, status=EpisodeStatus.REWARDED, train_step=None)


async def release_step_episodes(session: AsyncSession, run_id: str, step: int) -> None:
    """Hand a step's episodes back to the scheduler (rewarded, no step)."""
    await session.execute(_released(run_id, step))


def release_step_episodes_sync(session: Session, run_id: str, step: int) -> None:
    """`release_step_episodes` for the trainer's sync session."""
    session.execute(_released(run_id, step))


def mark_step_trained_sync(session: Session, run_id: str, step: int) -> None:
    session.execute(_step_episodes(run_id, step, status=EpisodeStatus.TRAINED))


def step_episodes_sync(session: Session, run_id: str, step: int) -> list[Episode]:
    """The episodes the scheduler assigned to `step`, by group then id."""
    stmt = (
        select(Episode)
        .where(Episode.run_id == run_id, Episode.train_step == step)
        .order_by(Episode.group_id, Episode.id)
    )
    return list(session.execute(stmt).scalars().all())


async def episode_group(session: AsyncSession, run_ids: list[str], episode_id: str) -> str | None:
    """The group of episode `episode_id` in any of the runs `run_ids` (a run's policies share
    episode ids, and an episode's group is the same in each); None: none of them has it."""
    stmt = (
        select(Episode.group_id)
        .where(Episode.run_id.in_(run_ids), Episode.id == episode_id)
        .order_by(Episode.created_at)
        .limit(1)
    )
    return (await session.execute(stmt)).scalar_one_or_none()
