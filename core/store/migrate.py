"""Apply or revert the Alembic migrations programmatically (no alembic.ini needed), one host
at a time.

Two hosts that start together would otherwise both read an old `alembic_version` and
both run the same DDL. On PostgreSQL the migration holds a session-level advisory lock
(`pg_advisory_lock(MIGRATION_LOCK_KEY)`) on the very connection Alembic migrates on:
the second host waits, then finds the schema at head and does nothing. On SQLite
(one host by nature, but several processes of `rlgate up --workers N`) an exclusive
`flock` on `<database>.migrate.lock` next to the file does the same; an in-memory
database needs none.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, text
from sqlalchemy.engine import make_url

import migrations
from core.store.db import make_sync_engine, normalize_url

# Any fixed 64-bit key; the same in every rlgate process ("rlgate\0mi" as an integer).
MIGRATION_LOCK_KEY = 0x726C676174650D69


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
    # ConfigParser interpolates '%': escape it (percent-encoded passwords).
    cfg.set_main_option("sqlalchemy.url", normalize_url(url, asynchronous=False).replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    with _locked_connection(url) as conn:
        cfg = alembic_config(url)
        cfg.attributes["connection"] = conn  # migrations/env.py runs on this one
        command.upgrade(cfg, revision)


def downgrade(url: str, revision: str = "base") -> None:
    with _locked_connection(url) as conn:
        cfg = alembic_config(url)
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)


@contextlib.contextmanager
def _locked_connection(url: str) -> Iterator[Connection]:
    """A connection to migrate on, holding the migration lock until it is closed."""
    engine = make_sync_engine(url)
    try:
        with _sqlite_file_lock(url), engine.connect() as conn:
            pg = conn.dialect.name == "postgresql"
            if pg:
                conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": MIGRATION_LOCK_KEY})
                conn.commit()  # the lock is the session's; Alembic opens its own transaction
            else:
                # SQLite rebuilds a table to alter it (batch mode): copy, drop, rename. With
                # foreign keys on, dropping a parent table would cascade to its children's
                # rows, so they are off while migrating (SQLite's own procedure for schema
                # changes), and checked once it is done. The pragma is ignored inside a
                # transaction: set before Alembic opens one.
                conn.exec_driver_sql("PRAGMA foreign_keys=OFF")
                conn.commit()
            try:
                yield conn
                conn.commit()
                if not pg:
                    _check_foreign_keys(conn)
            finally:
                if pg:
                    conn.rollback()
                    conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": MIGRATION_LOCK_KEY})
                    conn.commit()
    finally:
        engine.dispose()


def _check_foreign_keys(conn: Connection) -> None:
    """Raise if a migration left a row whose foreign key points nowhere (SQLite)."""
    broken = conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
    conn.commit()
    if broken:
        raise RuntimeError(f"the migration broke {len(broken)} foreign key(s): {broken[:5]}")


@contextlib.contextmanager
def _sqlite_file_lock(url: str) -> Iterator[None]:
    u = make_url(url)
    if u.get_backend_name() != "sqlite" or not u.database or u.database == ":memory:":
        yield
        return
    lock = Path(u.database).with_name(Path(u.database).name + ".migrate.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file is closed
        yield
