"""Engines for the store: async for the gateway, sync for the trainer and migrations."""

from __future__ import annotations

import time
from typing import Any, cast

from sqlalchemy import create_engine, event, exc
from sqlalchemy.engine import CursorResult, Engine, Result, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

# A pooled connection used this recently is handed out without a ping (HikariCP's
# `aliveBypassWindowMs` is the same idea at 0.5 s).
PING_AFTER_IDLE_S = 1.0


def rowcount(result: Result[Any]) -> int:
    """Rows an UPDATE or DELETE matched (its result is a `CursorResult`; `execute` is typed
    to return any `Result`)."""
    return cast("CursorResult[Any]", result).rowcount


def is_postgres(url: str) -> bool:
    return make_url(url).get_backend_name() == "postgresql"


def normalize_url(url: str, *, asynchronous: bool) -> str:
    """Pick the driver: aiosqlite/sqlite3 for SQLite, psycopg (v3, both modes) for PostgreSQL."""
    u = make_url(url)
    backend = u.get_backend_name()
    if backend == "sqlite":
        u = u.set(drivername="sqlite+aiosqlite" if asynchronous else "sqlite")
    elif backend == "postgresql":
        u = u.set(drivername="postgresql+psycopg")
    else:
        raise ValueError(f"unsupported database URL {url!r}: use sqlite:/// or postgresql://")
    return u.render_as_string(hide_password=False)


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    # WAL lets the gateway read while the trainer writes; busy_timeout waits instead of failing.
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def make_sync_engine(url: str) -> Engine:
    engine = create_engine(normalize_url(url, asynchronous=False), pool_pre_ping=True)
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def make_async_engine(
    url: str,
    pool_size: int = 24,
    *,
    pre_ping: bool = True,
    synchronous_commit: bool = True,
    autocommit: bool = False,
    ping_after_idle_s: float = PING_AFTER_IDLE_S,
    pool_timeout_s: float = 30,
) -> AsyncEngine:
    """The gateway's engine.

    `pre_ping` (PostgreSQL): a connection that sat in the pool for `ping_after_idle_s`
    or longer is checked with a round trip before it is handed out, and replaced if it
    is dead (`ping_stale_connections`). One used more recently goes out unchecked: a
    ping per checkout was one of the two round trips of a chat call's placement read.
    If such a connection did die (a server restart under load), its query raises, the
    request gets the outage's retryable 503 (`gateway/errors.py`), and SQLAlchemy
    replaces every connection of the pool opened before the failure.

    `synchronous_commit=False` (PostgreSQL): this engine's commits return once they are
    visible, before their WAL reaches the disk (the server flushes it within three
    `wal_writer_delay`s). A crash of the client loses nothing committed; a crash of the
    server can lose the last fraction of a second. Set once per connection, not per commit.

    `autocommit=True` (PostgreSQL): the pool of the statements every agent call runs
    straight on psycopg (`core.store.pg_driver`: its placement reads and the group commit).
    Its connections are in autocommit from the start and go back to the pool as they are:
    no ROLLBACK at check-in and no isolation level set and reset around each use. Through
    the main pool those two cost more CPU than the read they wrapped (SQLAlchemy's async
    adaption runs each as a greenlet hop). A statement that fails mid-transaction ends it
    itself (`core.store.capture_pg`), so no connection goes back inside one. Other
    databases have no such pool: the call path uses the main one there.
    """
    if not is_postgres(url):
        engine = create_async_engine(normalize_url(url, asynchronous=True), pool_pre_ping=pre_ping)
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        return engine
    # A fixed pool, no overflow: a connection past the pool is opened for one checkout
    # and closed after it, and PostgreSQL forks a backend for each (with 20 + 20 under
    # load, those forks took more CPU than the queries; with 32 + 16, two processes at
    # 512 clients also ran past the server's 100 connections). A request past the pool
    # waits for a connection, up to `pool_timeout_s`: past that it is a retryable 503
    # `database_busy` (`gateway/errors.py`), not a 500. So no code may ask for a second
    # connection while it holds one (tests/integration/test_admission_pool.py). Last in,
    # first out: under a light load the same few connections stay in use (no ping) and
    # the rest idle.
    kw: dict = {"pool_size": pool_size, "max_overflow": 0, "pool_timeout": pool_timeout_s}
    if autocommit:
        kw |= {"isolation_level": "AUTOCOMMIT", "pool_reset_on_return": None}
    engine = create_async_engine(normalize_url(url, asynchronous=True), pool_use_lifo=True, **kw)
    if not synchronous_commit:
        event.listen(engine.sync_engine, "connect", _no_flush_wait)
    if pre_ping:
        ping_stale_connections(engine, ping_after_idle_s)
    return engine


def _no_flush_wait(dbapi_connection, record) -> None:
    """`synchronous_commit=off` for this session, set once when the connection opens (a
    connect option would replace the user's own `options`, PGOPTIONS included)."""
    autocommit = dbapi_connection.autocommit
    dbapi_connection.autocommit = True  # a SET inside a transaction would be rolled back
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("SET synchronous_commit TO off")
    finally:
        cursor.close()
        dbapi_connection.autocommit = autocommit


def ping_stale_connections(engine: AsyncEngine, idle_s: float) -> None:
    """Ping a connection at checkout only if it was idle in the pool for `idle_s` or more.

    A dead one is replaced before it is handed out (the pool retries a checkout whose
    listener raises `DisconnectionError`).
    """
    pool, dialect = engine.sync_engine.pool, engine.sync_engine.dialect

    def checked_in(dbapi_connection, record) -> None:
        record.info["idle_since"] = time.monotonic()

    def checked_out(dbapi_connection, record, proxy) -> None:
        since = record.info.pop("idle_since", None)
        if since is None or time.monotonic() - since < idle_s:
            return  # just opened, or used a moment ago
        try:
            alive = dialect.do_ping(dbapi_connection)
        except Exception as err:
            raise exc.DisconnectionError(f"stale pooled connection: {err}") from err
        if not alive:
            raise exc.DisconnectionError("stale pooled connection")

    event.listen(pool, "checkin", checked_in)
    event.listen(pool, "checkout", checked_out)
