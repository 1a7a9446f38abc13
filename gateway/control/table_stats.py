"""Fresh planner statistics for the tables the gateway fills fastest.

PostgreSQL plans a session's repeated statements once and keeps the plan,
including the ones behind every foreign-key check of an insert. A run starts
on empty tables, so those plans are made for empty tables; as `episodes` and
`completions` grow by hundreds of rows a second, a plan that scans a table
costs more with every row: a process's capture rate halves within half a
minute of a fresh run, and recovers at once after an `ANALYZE` (which makes
every session plan again).
Autovacuum's analyze would fix it, but it may be off (it is on this project's
CI machines) and by default waits for 10 % of a table to change, checked once
a minute.

So the leader analyzes a table itself when the rows changed since its last
analyze exceed `min_rows + fraction x live rows` (500 + 20 %): a few dozen
analyzes over a million rows, each a sample of at most 30,000 rows of the
columns lookups filter on (the whole rows cost a 100 ms burst of server CPU).
PostgreSQL only; on SQLite there is nothing to do.
"""

from __future__ import annotations

import asyncio
import logging

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

logger = logging.getLogger(__name__)

# Written for every new conversation and every call; only the columns the gateway's and the
# foreign keys' lookups filter on are analyzed (the token ids, logprobs and messages would
# make each analyze several times dearer, for statistics no plan uses).
TABLES = {
    "episodes": ("run_id", "id", "group_id", "status"),
    "completions": ("run_id", "episode_id", "conv_hash", "created_at"),
}

_CHANGED = text(
    "SELECT relname, n_live_tup, n_mod_since_analyze FROM pg_stat_user_tables "
    "WHERE schemaname = current_schema() AND relname = ANY(:tables)"
)


class TableStats:
    """Analyzes `TABLES` when they grew past the threshold; `step` from the leader's loop."""

    def __init__(self, engine: AsyncEngine, *, min_rows: int = 500, fraction: float = 0.2) -> None:
        self.engine = engine
        self.min_rows = min_rows
        self.fraction = fraction
        self.enabled = engine.dialect.name == "postgresql"
        self.analyzed: dict[str, int] = {}  # table -> analyzes made (a figure for tests)
        # PostgreSQL resets a table's count of changed rows only after an ANALYZE of all its
        # columns: after ours (some columns), the count where it stood is remembered instead.
        self._counted: dict[str, int] = {}

    async def due(self) -> list[str]:
        """The tables whose changes since their last analyze passed the threshold."""
        due = []
        for name, live, changed in await self._changes():
            since = changed - self._counted.get(name, 0)
            if since < 0:  # a full ANALYZE (autovacuum's, an operator's) reset the count
                self._counted[name], since = 0, changed
            if since >= self.min_rows + self.fraction * live:
                due.append(name)
        return due

    async def step(self) -> list[str]:
        """Analyze what is due; the tables analyzed."""
        if not self.enabled:
            return []
        tables = await self.due()
        counts = {name: changed for name, _, changed in await self._changes()}
        for name in tables:
            # autocommit: ANALYZE outside a transaction block takes only a light lock
            async with self.engine.connect() as conn:
                conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
                columns = ", ".join(f'"{c}"' for c in TABLES[name])
                await conn.execute(text(f'ANALYZE "{name}" ({columns})'))
            self._counted[name] = counts.get(name, 0)
            self.analyzed[name] = self.analyzed.get(name, 0) + 1
            logger.info("analyzed %s (planner statistics were stale)", name)
        return tables

    async def _changes(self) -> list[tuple[str, int, int]]:
        """(table, live rows, rows changed since its last full analyze), per table."""
        async with self.engine.connect() as conn:
            rows = (await conn.execute(_CHANGED, {"tables": list(TABLES)})).all()
        return [(name, int(live), int(changed)) for name, live, changed in rows]

    async def run_forever(self, is_leader, interval_s: float = 5.0) -> None:
        """Every `interval_s`, while `is_leader()` (one process of those sharing the store)."""
        while self.enabled:
            await asyncio.sleep(interval_s)
            if not is_leader():
                continue
            try:
                await self.step()
            except DBAPIError as exc:  # no rights, or the database away: try again later
                logger.warning("could not analyze the capture tables: %s", exc)
            except Exception:
                logger.exception("table statistics pass failed")
