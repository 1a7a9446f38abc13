"""Engines for the store: async for the gateway, sync for the trainer and migrations."""

from __future__ import annotations

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine


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
    url: str, pool_size: int = 32, *, pre_ping: bool = True, synchronous_commit: bool = True
) -> AsyncEngine:
    """`pre_ping`: check each connection as it leaves the pool (a round trip each time); a
    user that keeps its connections busy and handles an outage itself can do without.

    `synchronous_commit=False` (PostgreSQL): this engine's commits return once they are
    visible, before their WAL reaches the disk (the server flushes it within three
    `wal_writer_delay`s). A crash of the client loses nothing committed; a crash of the
    server can lose the last fraction of a second. Set on the connection, so no round trip.
    """
    kw: dict = {}
    if make_url(url).get_backend_name() == "postgresql":
        # A fixed pool, no overflow: a connection past the pool is opened for one checkout
        # and closed after it, and PostgreSQL forks a backend for each (with 20 + 20 under
        # load, those forks took more CPU than the queries; with 32 + 16, two processes at
        # 512 clients also ran past the server's 100 connections). A request past the pool
        # waits for a connection. So no code may ask for a second connection while it
        # holds one (tests/integration/test_admission_pool.py).
        kw = {"pool_size": pool_size, "max_overflow": 0, "pool_timeout": 30}
        if not synchronous_commit:
            kw["connect_args"] = {"options": "-c synchronous_commit=off"}
    engine = create_async_engine(
        normalize_url(url, asynchronous=True), pool_pre_ping=pre_ping, **kw
    )
    if engine.dialect.name == "sqlite":
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
    return engine
