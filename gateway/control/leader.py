"""Which gateway process schedules training: a PostgreSQL advisory lock, with failover.

Several gateway processes may share one store (`rlgate up --workers N`, or
several hosts behind a load balancer). Exactly one of them at a time, the
leader, runs the training scheduler's loop (`TrainingScheduler`); every
process, leader or not, hot-swaps its own backend clients (`SwapLoop`),
because each holds backends of its own.

PostgreSQL (`AdvisoryLockLeader`): the leader holds a session-level
advisory lock (`LOCK_CLASS` and a hash of the current schema, so that stores
in other schemas of one database lead apart) on a connection opened for
nothing else. Every `interval_s` each process either checks that its lock
connection still answers (the leader) or tries `pg_try_advisory_lock` (the
others). A leader that dies, SIGKILL included, loses its connection and
PostgreSQL releases the lock with the session, so another process leads
within `interval_s` of that. A leader whose connection fails steps down at
once and tries again like any other. On shutdown the lock is released by
closing the connection.

The lock is for efficiency, not correctness: a step is claimed under the
run's row lock and the step's primary key (`TrainingScheduler._claim`), so
two processes that both believed they led (a connection PostgreSQL has not
yet seen die) still enqueue each step once.

SQLite (the embedded default, one process): that process always leads
(`SoleLeader`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from core.store.db import is_postgres, normalize_url

logger = logging.getLogger(__name__)

LOCK_CLASS = 0x726C6774  # "rlgt"; the lock's second key is the store's schema (see below)


class SoleLeader:
    """The only process on its store: it always leads."""

    is_leader = True

    async def step(self) -> bool:
        return True

    async def run_forever(self) -> None:
        await asyncio.Event().wait()

    async def close(self) -> None:
        return None


class AdvisoryLockLeader:
    """Leads while it holds PostgreSQL advisory lock `key` (see the module docstring)."""

    def __init__(self, url: str, interval_s: float = 1.0, lock_class: int = LOCK_CLASS) -> None:
        # A connection of its own, never pooled: the lock lives exactly as long as it does.
        self._engine: AsyncEngine = create_async_engine(
            normalize_url(url, asynchronous=True), poolclass=NullPool, isolation_level="AUTOCOMMIT"
        )
        self.interval_s = interval_s
        self.lock_class = lock_class
        self.is_leader = False
        self._conn: AsyncConnection | None = None

    async def step(self) -> bool:
        """One attempt: keep the lock (leader) or try to take it (others); whether we lead."""
        try:
            if self._conn is None:
                self._conn = await self._engine.connect()
            if self.is_leader:
                await self._conn.execute(text("SELECT 1"))
            else:
                got = await self._conn.scalar(
                    text("SELECT pg_try_advisory_lock(:cls, hashtext(current_schema()))"),
                    {"cls": self.lock_class},
                )
                if got:
                    self.is_leader = True
                    logger.info("gateway process %d leads: it schedules training", os.getpid())
        except Exception as exc:  # the database away: whoever led does not any more
            if self.is_leader:
                logger.warning("gateway process %d steps down as leader: %s", os.getpid(), exc)
            self.is_leader = False
            await self._drop()
        return self.is_leader

    async def run_forever(self) -> None:
        while True:
            await self.step()
            await asyncio.sleep(self.interval_s)

    async def close(self) -> None:
        """Release the lock so that another process leads at once, then its connection.

        Unlocked explicitly: the server releases a closed session's locks only once
        its backend has seen the disconnect, a moment after `close` returns.
        """
        if self.is_leader and self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.execute(
                    text("SELECT pg_advisory_unlock(:cls, hashtext(current_schema()))"),
                    {"cls": self.lock_class},
                )
        self.is_leader = False
        await self._drop()
        await self._engine.dispose()

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()


class LeaderCollector(Collector):
    """`rlgate_scheduler_leader{pid}`: whether this process schedules training (1) or not."""

    def __init__(self, leader: SoleLeader | AdvisoryLockLeader) -> None:
        self.leader = leader

    def collect(self) -> Iterator[Metric]:
        fam = GaugeMetricFamily(
            "rlgate_scheduler_leader", "this gateway process schedules training", labels=["pid"]
        )
        fam.add_metric([str(os.getpid())], int(self.leader.is_leader))
        yield fam


def make_leader(url: str, interval_s: float) -> SoleLeader | AdvisoryLockLeader:
    """The advisory lock on PostgreSQL; a sole leader on SQLite (one process)."""
    if is_postgres(url):
        return AdvisoryLockLeader(url, interval_s)
    return SoleLeader()
