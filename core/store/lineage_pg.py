"""The placement's reads on PostgreSQL, straight on psycopg.

`core.store.completions.find_by_conv_hash` and `ancestry` run their
statements through a row runner; this one compiles each statement once for
psycopg and reads each row through the columns' own result processors into a
`Completion` (`core.store.pg_driver`), where an ORM session (which SQLite
keeps) cost about three times the CPU. A chat call makes this lookup before
it samples.
"""

from __future__ import annotations

import functools
from typing import Any

import psycopg
from sqlalchemy import Select

from core.store.completions import Rows
from core.store.models import Completion
from core.store.pg_driver import (
    Statement,
    compiled,
    result_processors,
    row_values,
    type_codes,
)


@functools.cache
def _compiled(stmt: Select) -> Statement:
    """Once per statement: the store's statement builders are cached, so each is one object."""
    return compiled(stmt)


def rows_on(conn: psycopg.AsyncConnection) -> Rows:
    async def run(stmt: Select, params: dict[str, Any]) -> list[Completion]:
        sql, consts = _compiled(stmt)
        cur = await conn.execute(sql, {**consts, **params}, prepare=True)
        rows = await cur.fetchall()
        if not rows:
            return []
        columns = result_processors(Completion.__table__, type_codes(cur))
        return [Completion(**row_values(row, columns)) for row in rows]

    return run
