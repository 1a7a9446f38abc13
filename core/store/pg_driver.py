"""Straight on psycopg, for the few statements every call runs on PostgreSQL.

SQLAlchemy's execution, its ORM session and its async adaption cost several
times the statement itself: a parent lookup that finds nothing took 0.57 ms
of CPU through an ORM session and about 0.2 ms this way. So the call path's
statements (`core.store.capture_pg`, `core.store.lineage_pg`) are the
SQLAlchemy statements the rest of the store runs, compiled once for psycopg,
and run on a pooled connection's own psycopg connection. Values go through
the columns' own bind and result processors, so a row is stored and read
exactly as SQLAlchemy stores and reads it, and psycopg's errors are raised as
SQLAlchemy's (`DBAPIError.instance`), as the ORM path raises them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, cast

import psycopg
from sqlalchemy import Table
from sqlalchemy.dialects import postgresql
from sqlalchemy.exc import DBAPIError, StatementError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler

Processor = Callable[[Any], Any] | None
Statement = tuple[str, dict]  # SQL with named parameters, and its constant parameters


@functools.cache
def dialect() -> postgresql.psycopg.dialect:
    return postgresql.psycopg.dialect()


def compiled(stmt: ClauseElement, keys: tuple[str, ...] | None = None) -> Statement:
    """`stmt` as psycopg runs it (named `%(key)s` parameters), with its constant parameters
    (those the statement fixes itself; the caller gives the others)."""
    c = cast(SQLCompiler, stmt.compile(dialect=dialect(), column_keys=keys))
    return str(c), {k: v for k, v in c.params.items() if not c.binds[k].required}


def bind_processors(table: Table) -> tuple[tuple[str, Processor], ...]:
    """Per column of `table`, its key and the processor of a value written (None: as is)."""
    d = dialect()
    return tuple((c.key, c.type.dialect_impl(d).bind_processor(d)) for c in table.columns)


@functools.cache
def result_processors(
    table: Table, type_codes: tuple[int, ...]
) -> tuple[tuple[str, Processor], ...]:
    """Per column of `table`, its key and the processor of a value read (None: as is);
    `type_codes`: the server's type of each column of the result (`type_codes(cursor)`)."""
    d = dialect()
    return tuple(
        (c.key, c.type.dialect_impl(d).result_processor(d, code))
        for c, code in zip(table.columns, type_codes, strict=True)
    )


def type_codes(cursor: psycopg.AsyncCursor) -> tuple[int, ...]:
    return tuple(col.type_code for col in cursor.description or ())


def row_values(row: Sequence[Any], columns: tuple[tuple[str, Processor], ...]) -> dict[str, Any]:
    """A row of `SELECT <the table's columns>` as column key -> value, as SQLAlchemy reads it."""
    return {
        key: value if proc is None or value is None else proc(value)
        for (key, proc), value in zip(columns, row, strict=True)
    }


def as_sqlalchemy(err: psycopg.Error, invalidated: bool = False) -> StatementError:
    """psycopg's error as SQLAlchemy raises it (OperationalError, IntegrityError, ...)."""
    return DBAPIError.instance(None, None, err, psycopg.Error, connection_invalidated=invalidated)


def psycopg_engine(sessions: async_sessionmaker[AsyncSession]) -> AsyncEngine | None:
    """The engine `sessions` are bound to if it is PostgreSQL on psycopg (the driver these
    statements are for), else None."""
    engine: AsyncEngine | None = sessions.kw.get("bind")
    return engine if engine is not None and engine.dialect.driver == "psycopg" else None


@contextlib.asynccontextmanager
async def driver_connection(engine: AsyncEngine) -> AsyncIterator[psycopg.AsyncConnection]:
    """A pooled connection's psycopg connection for the block, in autocommit (a statement
    runs alone unless the block sends its own BEGIN and COMMIT). Cheapest from the call
    path's pool (`core.store.db.make_async_engine` with `autocommit`), whose connections
    are born in autocommit; another pool's connection is switched for the block.

    psycopg's errors leave the block as SQLAlchemy's; a connection one of them left
    broken is invalidated, so the pool opens a new one instead of handing it out again.
    """
    async with engine.connect() as conn:
        raw = (await conn.get_raw_connection()).driver_connection
        assert raw is not None  # a checked-out, valid connection has its driver's
        if not raw.autocommit:
            await conn.execution_options(isolation_level="AUTOCOMMIT")
        try:
            yield raw
        except psycopg.Error as err:
            broken = raw.broken or raw.closed
            if broken:
                await conn.invalidate()
            raise as_sqlalchemy(err, broken) from err
