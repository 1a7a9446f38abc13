"""The group commit's batch on PostgreSQL: straight on psycopg, one pipeline, one round trip.

The same writes as `gateway.services.capture.write_rows` does through
SQLAlchemy (which SQLite keeps), as three fixed statements: the batch's
episodes not stored yet, the reopening of those rewarded turn by turn, and
its completions. Values go through the columns' own SQLAlchemy bind
processors (JSON, packed token arrays), so a row is stored exactly as the
Core insert stores it. BEGIN and COMMIT are sent as statements on an
autocommit connection: psycopg's own transaction would sync after its BEGIN.
SQLAlchemy's statement building and its async adaption were most of a
one-row batch's time (4.6 ms against 0.5 ms for the pipeline itself).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

import psycopg
from sqlalchemy.dialects import postgresql

from gateway.store.completions import completion_values
from gateway.store.models import Completion
from gateway.store.status import EpisodeStatus

INSERT_EPISODES = (
    "INSERT INTO episodes (run_id, id, group_id, status, created_at) "
    "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (run_id, id) DO NOTHING"
)
REOPEN_REWARDED = (
    "UPDATE episodes SET status = %s, reward = NULL, rewarded_at = NULL "
    "WHERE run_id = %s AND id = %s AND status = %s AND NOT EXISTS ("
    "SELECT 1 FROM rewards WHERE rewards.run_id = episodes.run_id "
    "AND rewards.episode_id = episodes.id AND rewards.completion_id IS NULL)"
)


@functools.cache
def _completions() -> tuple[str, tuple[tuple[str, Callable[[Any], Any] | None], ...]]:
    """The completions INSERT and, per column, its bind processor (None: as is)."""
    dialect = postgresql.psycopg.dialect()
    columns = tuple(
        (c.key, c.type.dialect_impl(dialect).bind_processor(dialect))
        for c in Completion.__table__.columns
    )
    names = ", ".join(name for name, _ in columns)
    marks = ", ".join(["%s"] * len(columns))
    return f"INSERT INTO completions ({names}) VALUES ({marks})", columns


async def write_batch(
    conn: psycopg.AsyncConnection,
    episodes: list[dict[str, Any]],
    reopen: Iterable[tuple[str, str]],
    rows: list[Completion],
    now: datetime,
) -> None:
    """One transaction in one pipeline; raises psycopg's error of the first failed statement
    (nothing of the batch is then stored: the caller rolls the connection back)."""
    sql, columns = _completions()
    values = [
        tuple(v[name] if proc is None else proc(v[name]) for name, proc in columns)
        for v in completion_values(rows, now)
    ]
    async with conn.pipeline():
        cur = conn.cursor()
        await cur.execute("BEGIN")
        await cur.executemany(
            INSERT_EPISODES,
            [(e["run_id"], e["id"], e["group_id"], e["status"], e["created_at"]) for e in episodes],
        )
        reopening = [
            (EpisodeStatus.OPEN.value, run_id, ep_id, EpisodeStatus.REWARDED.value)
            for run_id, ep_id in reopen
        ]
        if reopening:
            await cur.executemany(REOPEN_REWARDED, reopening)
        await cur.executemany(sql, values)
        await cur.execute("COMMIT")
