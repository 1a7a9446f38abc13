"""The reads that place a call: its parent by conversation hash, and the parent's ancestry.

On PostgreSQL straight on psycopg (`core.store.lineage_pg`), elsewhere
through ORM sessions (`core.store.completions`); both run the same
statements. Each read is its own autocommit statement: completions never
change once stored, so a parent and its ancestry read apart see nothing torn,
and no BEGIN or ROLLBACK round trip is paid around them.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from core.store import completions, lineage_pg
from core.store.models import Completion
from core.store.pg_driver import driver_connection, psycopg_engine


class Lineage:
    """`sessions`: best on the call path's pool (`core.store.db.make_async_engine` with
    `autocommit`)."""

    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self._pg = psycopg_engine(sessions)
        self._sessions = sessions
        engine: AsyncEngine | None = sessions.kw.get("bind")
        if engine is not None and self._pg is None:
            self._sessions = async_sessionmaker(
                engine.execution_options(isolation_level="AUTOCOMMIT"), expire_on_commit=False
            )

    @contextlib.asynccontextmanager
    async def _rows(self) -> AsyncIterator[completions.Rows]:
        if self._pg is not None:
            async with driver_connection(self._pg) as conn:
                yield lineage_pg.rows_on(conn)
        else:
            async with self._sessions() as s:
                yield completions.rows_on(s)

    async def parent(
        self,
        run_id: str,
        hashes: dict[str, int],
        since: datetime,
        episode_id: str | None,
        family: list[str] | None = None,
    ) -> Completion | None:
        """`core.store.completions.find_by_conv_hash`: no connection if `hashes` is empty.
        `family`: the runs whose turns may share an episode (a run's policies)."""
        if not hashes:
            return None
        async with self._rows() as rows:
            return await completions.find_by_conv_hash(
                rows, run_id, hashes, since, episode_id, array=self._pg is not None, family=family
            )

    async def ancestry(self, parent: Completion | None) -> list[Completion]:
        """`parent`, its parent, and so on (nearest first); no connection for a first turn."""
        if parent is None or parent.parent_id is None:
            return [parent] if parent is not None else []
        async with self._rows() as rows:
            return await completions.ancestry(rows, parent)
