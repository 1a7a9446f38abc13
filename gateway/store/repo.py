"""Data access for the gateway: small async functions over an AsyncSession."""

from __future__ import annotations

import statistics
from collections import defaultdict
from datetime import UTC, datetime

from sqlalchemy import func, select, text, update
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.store.models import (
    ApiKey,
    Completion,
    Episode,
    PolicyVersion,
    Reward,
    Run,
    TrainStep,
)


async def run_for_key_hash(session: AsyncSession, key_hash: str) -> Run | None:
    stmt = (
        select(Run)
        .join(ApiKey, ApiKey.run_id == Run.id)
        .where(ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None))
    )
    return (await session.execute(stmt)).scalar_one_or_none()


# Episodes sent without a group id share this pseudo-group; see `select_batch`.
UNGROUPED = "~ungrouped"


async def get_or_create_episode(
    session: AsyncSession, run_id: str, episode_id: str, group_id: str | None
) -> Episode:
    ep = await session.get(Episode, (run_id, episode_id))
    if ep is None:
        ep = Episode(run_id=run_id, id=episode_id, group_id=group_id or UNGROUPED, status="open")
        session.add(ep)
        await session.flush()
    return ep


async def checkpoint_of(session: AsyncSession, run_id: str, version: int) -> str | None:
    pv = await session.get(PolicyVersion, (run_id, version))
    return pv.checkpoint_path if pv else None


async def lock_run_for_claim(session: AsyncSession, run_id: str) -> Run | None:
    """Open the claim's transaction holding the lock the trainer's commit needs, then read the run.

    Everything the claim reads afterwards (version, step rows, episodes) is
    then one consistent state: the trainer's commit of step N (version bump,
    step done, episodes trained, in one transaction) lands entirely before
    the claim or entirely after it, never between two of its reads.

    - PostgreSQL: `SELECT ... FOR UPDATE` on the run row. The trainer's
      commits start on that row too (`UPDATE runs ...` for a finished step,
      `SELECT ... FOR UPDATE` for a failed one), so they wait for the claim;
      under READ COMMITTED the claim's later statements then see no half of them.
    - SQLite: `BEGIN IMMEDIATE` takes the database's write lock before the
      first read (the driver would otherwise start the transaction only at
      the first write, leaving the reads unsnapshotted); the trainer's write
      waits for it (busy_timeout, see `gateway.store.db`).

    Call it first in a fresh `sessions.begin()` block.
    """
    if session.get_bind().dialect.name == "sqlite":
        await session.execute(text("BEGIN IMMEDIATE"))
    stmt = select(Run).where(Run.id == run_id).with_for_update()
    return (await session.execute(stmt)).scalar_one_or_none()


async def step_busy(session: AsyncSession, run_id: str, since: datetime) -> bool:
    """Whether a step of the run is queued or running and was (re)sent after `since`.

    A lock-free pre-check for the claim; the claim itself decides under its lock.
    """
    stmt = select(TrainStep.enqueued_at, TrainStep.created_at).where(
        TrainStep.run_id == run_id, TrainStep.status.in_(("queued", "running"))
    )
    return any(as_utc(sent or made) > since for sent, made in (await session.execute(stmt)).all())


async def claim_signature(session: AsyncSession, run_id: str) -> tuple:
    """What a claim's outcome depends on, besides the clock: cheap to read (two indexed queries).

    (run status, current version, rewarded episodes waiting, their latest reward time).
    """
    run = (
        await session.execute(select(Run.status, Run.current_version).where(Run.id == run_id))
    ).one_or_none()
    waiting = (
        await session.execute(
            select(func.count(), func.max(Episode.rewarded_at)).where(
                Episode.run_id == run_id, Episode.status == "rewarded"
            )
        )
    ).one()
    return (tuple(run) if run else None, tuple(waiting))


async def step_in_flight(session: AsyncSession, run_id: str) -> TrainStep | None:
    stmt = select(TrainStep).where(
        TrainStep.run_id == run_id, TrainStep.status.in_(("queued", "running"))
    )
    return (await session.execute(stmt)).scalars().first()


def as_utc(value: datetime) -> datetime:
    """SQLite returns naive datetimes; every time stored here is UTC."""
    return value if value.tzinfo else value.replace(tzinfo=UTC)


async def call_stats(session: AsyncSession, run_id: str) -> tuple[dict[str, int], int]:
    """Calls per episode-link kind, and the number of turns with template drift."""
    links = dict(
        (
            await session.execute(
                select(Completion.link, func.count())
                .where(Completion.run_id == run_id)
                .group_by(Completion.link)
            )
        ).all()
    )
    drift = (
        await session.execute(
            select(func.count()).where(Completion.run_id == run_id, Completion.drift.is_(True))
        )
    ).scalar_one()
    return {str(k): int(v) for k, v in links.items() if k is not None}, int(drift)


async def pending_episodes(session: AsyncSession, run_id: str) -> int:
    """Episodes sampled but not yet queued for training (open or rewarded)."""
    stmt = select(func.count()).where(
        Episode.run_id == run_id, Episode.status.in_(("open", "rewarded"))
    )
    return int((await session.execute(stmt)).scalar_one())


async def has_episode_reward(session: AsyncSession, ep: Episode) -> bool:
    """Whether an episode-level reward (not a per-turn one) was posted for `ep`."""
    stmt = select(func.count()).where(
        Reward.run_id == ep.run_id, Reward.episode_id == ep.id, Reward.completion_id.is_(None)
    )
    return (await session.execute(stmt)).scalar_one() > 0


def bump_counter(run: Run, name: str, by: int = 1) -> None:
    counters = dict(run.counters or {})
    counters[name] = int(counters.get(name, 0)) + by
    run.counters = counters  # reassign: JSON columns do not track in-place edits


async def refresh_episode_status(session: AsyncSession, ep: Episode) -> None:
    """An episode is ready ("rewarded") once it has an episode reward or all turns have one."""
    if ep.status != "open":
        return
    rewards = (
        (
            await session.execute(
                select(Completion.reward).where(
                    Completion.run_id == ep.run_id, Completion.episode_id == ep.id
                )
            )
        )
        .scalars()
        .all()
    )
    if ep.reward is None and rewards and all(r is not None for r in rewards):
        ep.reward = float(sum(rewards))
    if ep.reward is not None:
        ep.status = "rewarded"
        ep.rewarded_at = datetime.now(UTC)


async def select_batch(session: AsyncSession, run: Run, cfg) -> list[Episode]:
    """Pick the groups for the next step, dropping (and counting) what must not train.

    Expired: an open episode with no new call and no reward for
    `episode_timeout_s`. Incomplete: a group still short of `group_size` (or
    with open episodes) `group_timeout_s` after it started; by
    `incomplete_groups` its rewarded episodes train (if at least two) or are
    dropped. Stale: an episode any of whose completions was sampled more than
    `max_staleness` versions before the current one. Zero-variance: a group
    whose rewards are all equal gives every token zero advantage.
    Returns [] when fewer than `groups_per_step` good groups are ready.
    """
    eps = (
        (
            await session.execute(
                select(Episode).where(
                    Episode.run_id == run.id, Episode.status.in_(("open", "rewarded"))
                )
            )
        )
        .scalars()
        .all()
    )
    if not eps:
        return []
    rows = (
        await session.execute(
            select(
                Completion.episode_id,
                func.min(Completion.policy_version),
                func.max(Completion.created_at),
            )
            .where(Completion.run_id == run.id, Completion.episode_id.in_([e.id for e in eps]))
            .group_by(Completion.episode_id)
        )
    ).all()
    oldest = {r[0]: r[1] for r in rows}
    last_call = {r[0]: as_utc(r[2]) for r in rows}
    now = datetime.now(UTC)
    live: list[Episode] = []
    for ep in eps:
        idle = (now - last_call.get(ep.id, as_utc(ep.created_at))).total_seconds()
        if ep.status == "open" and idle > cfg.episode_timeout_s:
            ep.status = "expired"
            bump_counter(run, "expired_episodes")
        else:
            live.append(ep)
    groups: dict[str, list[Episode]] = defaultdict(list)
    for ep in live:
        groups[ep.group_id].append(ep)
    candidates = [m for g, m in groups.items() if g != UNGROUPED]
    candidates += _pool_chunks(groups.get(UNGROUPED, []), cfg.group_size)
    ready: list[list[Episode]] = []
    floor = run.current_version - cfg.max_staleness
    for members in sorted(candidates, key=lambda m: min(e.created_at for e in m)):
        complete = len(members) >= cfg.group_size and all(e.status == "rewarded" for e in members)
        if not complete:
            started = min(as_utc(e.created_at) for e in members)
            if (now - started).total_seconds() <= cfg.group_timeout_s:
                continue  # still filling up
            rewarded = [e for e in members if e.status == "rewarded"]
            if cfg.incomplete_groups == "drop" or len(rewarded) < 2:
                for e in rewarded:
                    e.status = "dropped"
                if rewarded:
                    bump_counter(run, "dropped_incomplete_groups")
                continue
            members = rewarded  # counted below if chosen
        if any(oldest.get(e.id, run.current_version) < floor for e in members):
            for e in members:
                e.status = "dropped"
            bump_counter(run, "dropped_stale_episodes", len(members))
            continue
        if statistics.pstdev([float(e.reward) for e in members]) == 0.0:
            for e in members:
                e.status = "dropped"
            bump_counter(run, "skipped_zero_variance_groups")
            continue
        ready.append(members)
    if len(ready) < cfg.groups_per_step:
        return []
    chosen = ready[: cfg.groups_per_step]
    short = sum(1 for m in chosen if len(m) < cfg.group_size)
    if short:
        bump_counter(run, "trained_incomplete_groups", short)
    for members in chosen:
        if members[0].group_id == UNGROUPED:
            for e in members:  # the pool chunk becomes a group of its own from here on
                e.group_id = f"~pool-{members[0].id}"[:100]
    return [e for members in chosen for e in members]


def _pool_chunks(pool: list[Episode], size: int) -> list[list[Episode]]:
    """Rewarded ungrouped episodes, oldest first, in chunks of `size`.

    Such episodes did not say which task they attempted, so a chunk's mean
    is a batch baseline rather than GRPO's same-task baseline; it still lets
    them train instead of waiting forever for group-mates.
    """
    rewarded = sorted((e for e in pool if e.status == "rewarded"), key=lambda e: e.created_at)
    return [rewarded[i : i + size] for i in range(0, len(rewarded) - size + 1, size)]


async def mark_queued(
    session: AsyncSession, run_id: str, episodes: list[Episode], step: int
) -> None:
    await session.execute(
        update(Episode)
        .where(Episode.run_id == run_id, Episode.id.in_([e.id for e in episodes]))
        .values(status="queued", train_step=step)
    )
