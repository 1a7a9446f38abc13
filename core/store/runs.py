"""Runs and their policy versions: lookups, the claim's lock, the version bump, delete."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Table, delete, func, select, text, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from core.store.db import rowcount
from core.store.models import Base, Episode, PolicyVersion, Run
from core.store.status import EpisodeStatus


async def list_runs(session: AsyncSession) -> list[Run]:
    """Every run, oldest first."""
    return list((await session.execute(select(Run).order_by(Run.created_at))).scalars())


async def active_run_ids(session: AsyncSession) -> list[str]:
    return list((await session.execute(select(Run.id).where(Run.status == "active"))).scalars())


async def run_version(session: AsyncSession, run_id: str) -> int | None:
    """The run's newest policy version (None: no such run)."""
    stmt = select(Run.current_version).where(Run.id == run_id)
    return (await session.execute(stmt)).scalar_one_or_none()


async def run_versions(session: AsyncSession, run_ids: list[str]) -> dict[str, int]:
    """The newest policy version of each of `run_ids` that exists, in one query."""
    stmt = select(Run.id, Run.current_version).where(Run.id.in_(run_ids))
    return {run_id: version for run_id, version in (await session.execute(stmt)).tuples()}


def bump_counter(run: Run, name: str, by: int = 1) -> None:
    counters = dict(run.counters or {})
    counters[name] = int(counters.get(name, 0)) + by
    run.counters = counters  # reassign: JSON columns do not track in-place edits


async def lock_run_for_claim(session: AsyncSession, run_id: str) -> Run | None:
    """Open the claim's transaction holding the lock the trainer's commit needs, then read the run.

    Everything the claim reads afterwards (version, step rows, episodes) is
    then one consistent state: the trainer's commit of step N (version bump,
    step done, episodes trained, in one transaction) lands entirely before
    the claim or entirely after it, never between two of its reads.

    - PostgreSQL: `SELECT ... FOR NO KEY UPDATE` on the run row. The
      trainer's commits start on that row too (`advance_version_sync` for a
      finished step, `lock_run_sync` for a failed one), so they wait for the
      claim; under READ COMMITTED the claim's later statements then see no
      half of them. Not `FOR UPDATE`: that also blocks the `FOR KEY SHARE`
      lock every insert of an episode or completion takes on its run (the
      foreign key), so every captured completion waited for the claim's
      whole scan, and streaming calls' p99 latency grew with it.
    - SQLite: `BEGIN IMMEDIATE` takes the database's write lock before the
      first read (the driver would otherwise start the transaction only at
      the first write, leaving the reads unsnapshotted); the trainer's write
      waits for it (busy_timeout, see `core.store.db`).

    Call it first in a fresh `sessions.begin()` block.
    """
    if session.get_bind().dialect.name == "sqlite":
        await session.execute(text("BEGIN IMMEDIATE"))
    stmt = select(Run).where(Run.id == run_id).with_for_update(key_share=True)
    return (await session.execute(stmt)).scalar_one_or_none()


def set_counter_sync(session: Session, run_id: str, name: str, value: Any) -> None:
    """Set one of the run's counters, keeping the others as they are at the write.

    The no-op update first takes the run row's lock (PostgreSQL) or the database's write
    lock (SQLite) before the counters are read, so a counter another process bumps in
    between is not lost. Call it in a `sessions.begin()` block."""
    session.execute(update(Run).where(Run.id == run_id).values(status=Run.status))
    run = session.get(Run, run_id)
    if run is not None:
        run.counters = {**(run.counters or {}), name: value}


def lock_run_sync(session: Session, run_id: str) -> None:
    """`SELECT ... FOR UPDATE` on the run row: the trainer's commits start here, like a claim."""
    session.execute(select(Run.id).where(Run.id == run_id).with_for_update())


async def claim_signature(session: AsyncSession, run_id: str) -> tuple:
    """What a claim's outcome depends on, besides the clock: cheap to read (two indexed queries).

    (run status, current version, config, rewarded episodes waiting, their latest reward
    time).
    """
    stmt = select(Run.status, Run.current_version, Run.config).where(Run.id == run_id)
    run = (await session.execute(stmt)).one_or_none()
    waiting = (
        await session.execute(
            select(func.count(), func.max(Episode.rewarded_at)).where(
                Episode.run_id == run_id, Episode.status == EpisodeStatus.REWARDED
            )
        )
    ).one()
    return (tuple(run) if run else None, tuple(waiting))


def _advance(run_id: str, version: int):
    return (
        update(Run)
        .where(Run.id == run_id, Run.current_version == version)
        .values(current_version=version + 1)
    )


async def advance_version(session: AsyncSession, run_id: str, version: int) -> bool:
    """Move the run from `version` to `version + 1`; False if it is no longer at `version`."""
    return rowcount(await session.execute(_advance(run_id, version))) == 1


def advance_version_sync(session: Session, run_id: str, version: int) -> bool:
    """`advance_version` for the trainer's sync session."""
    return rowcount(session.execute(_advance(run_id, version))) == 1


async def checkpoint_of(session: AsyncSession, run_id: str, version: int) -> str | None:
    pv = await session.get(PolicyVersion, (run_id, version))
    return pv.checkpoint_path if pv else None


async def policy_versions(session: AsyncSession, run_id: str) -> list[PolicyVersion]:
    """Every version of the run, oldest first."""
    stmt = (
        select(PolicyVersion).where(PolicyVersion.run_id == run_id).order_by(PolicyVersion.version)
    )
    return list((await session.execute(stmt)).scalars())


def policy_versions_sync(session: Session, run_id: str) -> list[PolicyVersion]:
    """`policy_versions` for the trainer's sync session."""
    stmt = (
        select(PolicyVersion).where(PolicyVersion.run_id == run_id).order_by(PolicyVersion.version)
    )
    return list(session.execute(stmt).scalars())


def run_tables() -> list[Table]:
    """Every table holding a run's rows, children first (so the delete also holds where
    foreign keys are not enforced); tables added later are covered without a change here.
    Importing `core.store` registers every table, `responses` included."""
    tables = reversed(Base.metadata.sorted_tables)
    return [t for t in tables if "run_id" in t.c and t.name != Run.__tablename__]


async def policy_runs(session: AsyncSession, parent_id: str) -> list[Run]:
    """The runs of the policies of run `parent_id`, oldest (first declared) first."""
    stmt = select(Run).where(Run.parent_id == parent_id).order_by(Run.created_at, Run.id)
    return list((await session.execute(stmt)).scalars())


async def delete_run(session: AsyncSession, run_id: str) -> None:
    """The run, its policies' runs and every row of them, inside the caller's transaction."""
    for child in await policy_runs(session, run_id):
        await delete_run(session, child.id)
    for table in run_tables():
        await session.execute(delete(table).where(table.c.run_id == run_id))
    await session.execute(delete(Run).where(Run.id == run_id))
