"""Completions: the captured calls, written in bulk and read per episode, parent or run."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Integer,
    Select,
    String,
    any_,
    bindparam,
    func,
    insert,
    literal_column,
    select,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session
from sqlalchemy.sql.schema import ScalarElementColumnDefault

from core.store.models import Completion

_COLUMNS = tuple(c.key for c in Completion.__table__.columns)
_DEFAULTS = {
    c.key: c.default.arg
    for c in Completion.__table__.columns
    if isinstance(c.default, ScalarElementColumnDefault)
}


def completion_values(rows: list[Completion], now: datetime) -> list[dict]:
    """Each row's columns as inserted, every default filled in on the row too (the caller
    reads them back from the transient objects)."""
    values = []
    for row in rows:
        if row.created_at is None:
            row.created_at = now
        for name, default in _DEFAULTS.items():
            if getattr(row, name) is None:
                setattr(row, name, default)
        values.append({name: getattr(row, name) for name in _COLUMNS})
    return values


async def insert_completions(session: AsyncSession, rows: list[Completion], now: datetime) -> None:
    """Insert `rows` inside the caller's transaction, leaving them transient.

    Core executemany on the session's connection, not the ORM unit of work nor
    its bulk insert: a few times less CPU per row. The row objects stay
    transient, with every column filled as the caller will read it.
    """
    conn = await session.connection()
    await conn.execute(insert(Completion.__table__), completion_values(rows, now))


# A prefix match is nearly always one row (the same episode's previous turn): read up to
# this many candidates with one prebuilt statement and rank them here; past it, look the
# hashes up one at a time, the highest rank first.
CANDIDATES = 64
# The most ancestors a call's parent chain is read with (`ancestors_stmt`).
ANCESTRY_LIMIT = 256


def _of_run(stmt: Select, with_episode: bool, family: bool = False, array: bool = False) -> Select:
    """Of the run `:run_id` (`family`: of any of the runs `:run_ids`, a run's policies;
    `array`: one PostgreSQL array parameter, else an expanding IN)."""
    if family and array:
        stmt = stmt.where(Completion.run_id == any_(bindparam("run_ids", type_=ARRAY(String))))
    elif family:
        stmt = stmt.where(Completion.run_id.in_(bindparam("run_ids", expanding=True)))
    else:
        stmt = stmt.where(Completion.run_id == bindparam("run_id"))
    stmt = stmt.where(Completion.created_at >= bindparam("since"))
    if with_episode:
        stmt = stmt.where(Completion.episode_id == bindparam("episode_id"))
    return stmt


@functools.cache
def candidates_stmt(with_episode: bool, array: bool = False, family: bool = False) -> Select:
    """The run's newest completions (of `:episode_id`) since `:since` whose hash is one of
    `:hashes`, at most `CANDIDATES + 1`. Prebuilt once: building an ORM select per call
    cost more CPU than running it. `array`: `:hashes` is one PostgreSQL array parameter
    (`= ANY`), for a statement compiled once (`core.store.lineage_pg`); otherwise an
    expanding IN."""
    if array:
        matches = Completion.conv_hash == any_(bindparam("hashes", type_=ARRAY(String)))
    else:
        matches = Completion.conv_hash.in_(bindparam("hashes", expanding=True))
    stmt = _of_run(select(Completion).where(matches), with_episode, family, array)
    return stmt.order_by(Completion.created_at.desc()).limit(CANDIDATES + 1)


@functools.cache
def newest_with_hash_stmt(with_episode: bool, family: bool = False, array: bool = False) -> Select:
    """The run's newest completion (of `:episode_id`) since `:since` hashed `:hash`."""
    stmt = _of_run(
        select(Completion).where(Completion.conv_hash == bindparam("hash")),
        with_episode,
        family,
        array,
    )
    return stmt.order_by(Completion.created_at.desc()).limit(1)


@functools.cache
def ancestors_stmt() -> Select:
    """The completion `:id` and its ancestors, nearest first, at most `:limit` of them:
    one recursive query however long the episode."""
    depth = literal_column("1", Integer).label("depth")
    chain = (
        select(Completion.id, Completion.parent_id, depth)
        .where(Completion.id == bindparam("id"))
        .cte("chain", recursive=True)
    )
    up = select(Completion.id, Completion.parent_id, chain.c.depth + 1).join(
        chain, Completion.id == chain.c.parent_id
    )
    chain = chain.union_all(up.where(chain.c.depth < bindparam("limit")))
    return select(Completion).join(chain, Completion.id == chain.c.id).order_by(chain.c.depth)


def best_candidate(found: list[Completion], hashes: dict[str, int]) -> Completion | None:
    """Of `found`, the newest of those with the highest rank (`hashes`: hash -> rank)."""

    def rank(c: Completion) -> tuple[int, datetime]:
        assert c.conv_hash is not None  # each one was found by its hash
        return hashes[c.conv_hash], c.created_at

    return max(found, key=rank, default=None)


def by_rank(hashes: dict[str, int]) -> list[str]:
    """The hashes, the highest rank (the longest prefix) first."""
    return sorted(hashes, key=hashes.__getitem__, reverse=True)


# Runs a SELECT of completions with its parameters: through an ORM session (`rows_on`),
# or straight on psycopg (`core.store.lineage_pg.rows_on`).
Rows = Callable[[Select, dict[str, Any]], Awaitable[list[Completion]]]


def rows_on(session: AsyncSession) -> Rows:
    async def run(stmt: Select, params: dict[str, Any]) -> list[Completion]:
        return list((await session.execute(stmt, params)).scalars())

    return run


async def find_by_conv_hash(
    rows: Rows,
    run_id: str,
    hashes: dict[str, int],
    since: datetime,
    episode_id: str | None,
    *,
    array: bool = False,
    family: list[str] | None = None,
) -> Completion | None:
    """Of the run's completions (of `episode_id`, if given) since `since` whose messages plus
    answer hash to one of `hashes`, the newest of those with the highest rank (`hashes` maps
    each hash to its rank): one statement, however many hashes (nearly always). `array`: as
    `candidates_stmt`."""
    if not hashes:
        return None
    mine = episode_id is not None
    params = {"run_id": run_id, "hashes": list(hashes), "since": since, "episode_id": episode_id}
    many = family is not None and len(family) > 1
    if many:
        params["run_ids"] = family
    found = await rows(candidates_stmt(mine, array, many), params)
    if len(found) <= CANDIDATES:
        return best_candidate(found, hashes)
    for h in by_rank(hashes):
        best = await rows(newest_with_hash_stmt(mine, many, array), params | {"hash": h})
        if best:
            return best[0]
    return None


async def ancestry(rows: Rows, parent: Completion | None) -> list[Completion]:
    """`parent`, its parent, and so on (nearest first), at most `ANCESTRY_LIMIT`."""
    if parent is None or parent.parent_id is None:
        return [parent] if parent is not None else []
    params = {"id": parent.parent_id, "limit": ANCESTRY_LIMIT - 1}
    return [parent, *await rows(ancestors_stmt(), params)]


def _of_episodes(run_id: str, episode_ids: list[str]) -> Select:
    return (
        select(Completion)
        .where(Completion.run_id == run_id, Completion.episode_id.in_(episode_ids))
        .order_by(Completion.created_at, Completion.id)
    )


async def episode_completions(
    session: AsyncSession, run_id: str, episode_ids: list[str]
) -> list[Completion]:
    """The completions of the given episodes, in the order they were made."""
    return list((await session.execute(_of_episodes(run_id, episode_ids))).scalars())


def episode_completions_sync(
    session: Session, run_id: str, episode_ids: list[str]
) -> list[Completion]:
    """`episode_completions` for the trainer's sync session."""
    return list(session.execute(_of_episodes(run_id, episode_ids)).scalars())


async def turn_stats(
    session: AsyncSession, run_id: str, episode_ids: list[str]
) -> dict[str, tuple[int, list[int]]]:
    """Episode -> (completions, every policy version that sampled a token of them, ascending).

    A completion sampled across a keep-mode swap counts each version in its
    `version_starts`, not only its `policy_version` (the oldest).
    """
    if not episode_ids:
        return {}
    rows = await session.execute(
        select(Completion.episode_id, Completion.policy_version, Completion.version_starts).where(
            Completion.run_id == run_id, Completion.episode_id.in_(episode_ids)
        )
    )
    turns: dict[str, int] = {}
    versions: dict[str, set[int]] = {}
    for ep_id, version, starts in rows.all():
        turns[ep_id] = turns.get(ep_id, 0) + 1
        versions.setdefault(ep_id, set()).update([int(version), *(int(v) for _, v in starts or ())])
    return {k: (n, sorted(versions[k])) for k, n in turns.items()}


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


async def count_completions(session: AsyncSession, run_id: str) -> int:
    stmt = select(func.count()).where(Completion.run_id == run_id)
    return int((await session.execute(stmt)).scalar_one())
