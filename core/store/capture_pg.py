"""The group commit's batch on PostgreSQL: straight on psycopg, one round trip.

The same three statements as `gateway.agent.capture.write_rows` runs
through SQLAlchemy (which SQLite keeps), compiled once for psycopg: the
batch's episodes not stored yet, the reopening of those rewarded turn by
turn, and its completions. Values go through the columns' own SQLAlchemy bind
processors (JSON, packed token arrays), so a row is stored exactly as the
Core insert stores it. BEGIN and COMMIT are sent as statements on an
autocommit connection: psycopg's own transaction would sync after its BEGIN.
SQLAlchemy's execution and its async adaption were most of a one-row batch's
time (4.6 ms against 0.5 ms for the pipeline itself); `core.store.pg_driver`
hands out the connection and raises psycopg's errors as SQLAlchemy's.

A small batch (what a light load makes: one or two rows) goes as ONE
statement instead: the completions' multi-row INSERT, with the new episodes'
INSERT and the reopening UPDATE as data-modifying CTEs of it, atomic on its
own in autocommit. psycopg's pipeline waits on the event loop once per
statement and per row, and each wait let other calls' work run first: at 4
clients a one-row batch took 1.9 ms where it takes 0.6 ms alone; as one
statement, 1.3 ms. A larger batch (a heavy load) keeps the pipeline, whose
three statements are prepared once for every size; the one-statement form is
compiled once per shape (episodes, reopenings, rows), so it is kept to
`ONE_STATEMENT_ROWS` rows.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable
from datetime import datetime
from typing import Any

import psycopg
from sqlalchemy import bindparam, insert
from sqlalchemy.dialects.postgresql import insert as pg_insert

from core.store.completions import completion_values
from core.store.episodes import (
    EPISODE_KEYS,
    insert_episodes_stmt,
    reopen_some_stmt,
    reopen_stmt,
)
from core.store.models import Completion, Episode
from core.store.pg_driver import Processor, Statement, bind_processors, compiled


@functools.cache
def _statements() -> tuple[Statement, Statement, str, tuple[tuple[str, Processor], ...]]:
    """The episodes INSERT, the reopening UPDATE and the completions INSERT, and per
    completions column its bind processor (None: as is)."""
    columns = bind_processors(Completion.__table__)
    completions, _ = compiled(insert(Completion.__table__), tuple(name for name, _ in columns))
    return (
        compiled(insert_episodes_stmt("postgresql"), EPISODE_KEYS),
        compiled(reopen_stmt()),
        completions,
        columns,
    )


# The most rows a batch may have to go as one statement (`_one_statement`).
ONE_STATEMENT_ROWS = 4


@functools.cache
def _one_statement(episodes: int, reopened: int, rows: int) -> Statement:
    """A batch of this shape as one statement: parameters `e<i>_<column>` (episodes),
    `r<i>_run` and `r<i>_episode` (reopenings) and `c<i>_<column>` (completions), and
    its constant parameters."""
    ep, c = Episode.__table__, Completion.__table__

    def values(table, keys, prefix: str, n: int) -> list[dict]:
        return [
            {k: bindparam(f"{prefix}{i}_{k}", type_=table.c[k].type) for k in keys}
            for i in range(n)
        ]

    stmt = insert(c).values(values(c, c.columns.keys(), "c", rows))
    new = pg_insert(ep).values(values(ep, EPISODE_KEYS, "e", episodes))
    stmt = stmt.add_cte(new.on_conflict_do_nothing(index_elements=["run_id", "id"]).cte("new"))
    if reopened:
        stmt = stmt.add_cte(reopen_some_stmt(reopened).cte("reopened"))
    return compiled(stmt)


async def _as_one_statement(
    conn: psycopg.AsyncConnection,
    episodes: list[dict[str, Any]],
    reopen: list[tuple[str, str]],
    values: list[dict[str, Any]],
) -> None:
    sql, params = _one_statement(len(episodes), len(reopen), len(values))
    params = dict(params)
    for i, e in enumerate(episodes):
        params.update({f"e{i}_{k}": v for k, v in e.items()})
    for i, (run_id, ep_id) in enumerate(reopen):
        params[f"r{i}_run"], params[f"r{i}_episode"] = run_id, ep_id
    for i, v in enumerate(values):
        params.update({f"c{i}_{k}": x for k, x in v.items()})
    await conn.execute(sql, params, prepare=True)


async def write_batch(
    conn: psycopg.AsyncConnection,
    episodes: list[dict[str, Any]],
    reopen: Iterable[tuple[str, str]],
    rows: list[Completion],
    now: datetime,
) -> None:
    """One transaction on an autocommit connection (`driver_connection`): one statement
    for a small batch, else one pipeline.

    Raises psycopg's error for the first failed statement; nothing of the batch is then
    stored, and the connection is left outside any transaction.
    """
    (insert_episodes, _), (reopen_sql, reopen_consts), completions, columns = _statements()
    values = [
        {name: v[name] if proc is None else proc(v[name]) for name, proc in columns}
        for v in completion_values(rows, now)
    ]
    reopen = list(reopen)
    if len(values) <= ONE_STATEMENT_ROWS:
        await _as_one_statement(conn, episodes, reopen, values)
        return
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
    except BaseException:
        # A failed statement makes the pipeline skip the rest, COMMIT included, and
        # leaves the server's transaction aborted: end it before the connection goes back.
        with contextlib.suppress(Exception):
            await conn.execute("ROLLBACK")
        raise
