"""The group commit's batch on PostgreSQL: straight on psycopg, one pipeline, one round trip.

The same three statements as `gateway.services.capture.write_rows` runs
through SQLAlchemy (which SQLite keeps), compiled once for psycopg: the
batch's episodes not stored yet, the reopening of those rewarded turn by
turn, and its completions. Values go through the columns' own SQLAlchemy bind
processors (JSON, packed token arrays), so a row is stored exactly as the
Core insert stores it. BEGIN and COMMIT are sent as statements on an
autocommit connection: psycopg's own transaction would sync after its BEGIN.
SQLAlchemy's execution and its async adaption were most of a one-row batch's
time (4.6 ms against 0.5 ms for the pipeline itself). psycopg's errors are
raised as SQLAlchemy's (`DBAPIError.instance`), as that path raises them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

import psycopg
from sqlalchemy import insert
from sqlalchemy.dialects import postgresql
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql import ClauseElement

from gateway.store.completions import completion_values
from gateway.store.episodes import EPISODE_KEYS, insert_episodes_stmt, reopen_stmt
from gateway.store.models import Completion

Processor = Callable[[Any], Any] | None
Statement = tuple[str, dict]  # SQL with named parameters, and its constant parameters


@functools.cache
def _dialect() -> postgresql.psycopg.dialect:
    return postgresql.psycopg.dialect()


def _compiled(stmt: ClauseElement, keys: tuple[str, ...] | None = None) -> Statement:
    """`stmt` as psycopg runs it (named `%(key)s` parameters), with its constant parameters."""
    compiled = stmt.compile(dialect=_dialect(), column_keys=keys)
    return str(compiled), dict(compiled.params)


@functools.cache
def _statements() -> tuple[
    tuple[str, dict], tuple[str, dict], str, tuple[tuple[str, Processor], ...]
]:
    """The episodes INSERT, the reopening UPDATE and the completions INSERT, and per
    completions column its bind processor (None: as is)."""
    dialect = _dialect()
    columns = tuple(
        (c.key, c.type.dialect_impl(dialect).bind_processor(dialect))
        for c in Completion.__table__.columns
    )
    completions, _ = _compiled(insert(Completion.__table__), tuple(name for name, _ in columns))
    episodes, _ = _compiled(insert_episodes_stmt("postgresql"), EPISODE_KEYS)
    return episodes, _compiled(reopen_stmt()), completions, columns


async def write_batch(
    conn: psycopg.AsyncConnection,
    episodes: list[dict[str, Any]],
    reopen: Iterable[tuple[str, str]],
    rows: list[Completion],
    now: datetime,
) -> None:
    """One transaction in one pipeline; raises SQLAlchemy's error for the first failed
    statement (nothing of the batch is then stored: the caller rolls the connection back)."""
    insert_episodes, (reopen_sql, reopen_consts), completions, columns = _statements()
    values = [
        {name: v[name] if proc is None else proc(v[name]) for name, proc in columns}
        for v in completion_values(rows, now)
    ]
    reopening = [
        {**reopen_consts, "key_run": run_id, "key_episode": ep_id} for run_id, ep_id in reopen
    ]
    try:
        async with conn.pipeline():
            cur = conn.cursor()
            await cur.execute("BEGIN")
            await cur.executemany(insert_episodes, episodes)
            if reopening:
                await cur.executemany(reopen_sql, reopening)
            await cur.executemany(completions, values)
            await cur.execute("COMMIT")
    except psycopg.Error as err:
        raise DBAPIError.instance(None, None, err, psycopg.Error) from err
