"""A call's parent and the parent's ancestry on PostgreSQL, straight on psycopg.

The same statements as `gateway.store.completions.find_by_conv_hash` and
`ancestry` run through an ORM session (which SQLite keeps), compiled once for
psycopg, and each row read through the columns' own result processors into a
`Completion` (`gateway.store.pg_driver`). A chat call makes this lookup before
it samples; through the ORM it cost about three times the CPU.
"""

from __future__ import annotations

import functools
from datetime import datetime
from typing import Any

import psycopg

from gateway.store import completions
from gateway.store.completions import (
    ancestors_stmt,
    best_candidate,
    by_rank,
    candidates_stmt,
    newest_with_hash_stmt,
)
from gateway.store.models import Completion
from gateway.store.pg_driver import (
    Statement,
    compiled,
    result_processors,
    row_values,
    type_codes,
)


@functools.cache
def _statement(name: str, with_episode: bool = False) -> Statement:
    if name == "candidates":
        return compiled(candidates_stmt(with_episode, array=True))
    if name == "newest":
        return compiled(newest_with_hash_stmt(with_episode))
    return compiled(ancestors_stmt())


async def _rows(conn: psycopg.AsyncConnection, stmt: Statement, params: dict) -> list[Completion]:
    sql, consts = stmt
    cur = await conn.execute(sql, {**consts, **params}, prepare=True)
    rows = await cur.fetchall()
    if not rows:
        return []
    columns = result_processors(Completion.__table__, type_codes(cur))
    return [Completion(**row_values(row, columns)) for row in rows]


async def find_by_conv_hash(
    conn: psycopg.AsyncConnection,
    run_id: str,
    hashes: dict[str, int],
    since: datetime,
    episode_id: str | None,
) -> Completion | None:
    """`gateway.store.completions.find_by_conv_hash` on `conn`."""
    if not hashes:
        return None
    mine = episode_id is not None
    params: dict[str, Any] = {"run_id": run_id, "since": since, "episode_id": episode_id}
    found = await _rows(conn, _statement("candidates", mine), params | {"hashes": list(hashes)})
    if len(found) <= completions.CANDIDATES:
        return best_candidate(found, hashes)
    for h in by_rank(hashes):
        best = await _rows(conn, _statement("newest", mine), params | {"hash": h})
        if best:
            return best[0]
    return None


async def ancestry(conn: psycopg.AsyncConnection, parent: Completion | None) -> list[Completion]:
    """`gateway.store.completions.ancestry` on `conn`."""
    if parent is None or parent.parent_id is None:
        return [parent] if parent is not None else []
    params = {"id": parent.parent_id, "limit": completions.ANCESTRY_LIMIT - 1}
    return [parent, *await _rows(conn, _statement("ancestors"), params)]
