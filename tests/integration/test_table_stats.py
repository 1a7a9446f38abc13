"""The leader analyzes the capture tables once they outgrow their planner statistics.

Real PostgreSQL (a fresh database per test; this machine's server runs with autovacuum
off, as a deployment may). Statistics counters reach `pg_stat_user_tables` a moment after
a commit, so the test waits for them, boundedly.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from sqlalchemy import insert, text
from sqlalchemy.ext.asyncio import AsyncEngine

from core.store.db import make_async_engine
from core.store.migrate import upgrade
from core.store.models import Episode, Run
from gateway.control.table_stats import TableStats

pytestmark = pytest.mark.integration


async def _episodes(engine: AsyncEngine, start: int, n: int) -> None:
    async with engine.begin() as conn:
        rows = [
            {"run_id": "r", "id": f"e{i}", "group_id": "g", "status": "open"}
            for i in range(start, start + n)
        ]
        await conn.execute(insert(Episode.__table__), rows)


async def _analyze_count(engine: AsyncEngine, table: str) -> int:
    async with engine.connect() as conn:
        stmt = text(
            "SELECT analyze_count FROM pg_stat_user_tables "
            "WHERE schemaname = current_schema() AND relname = :t"
        )
        return int((await conn.execute(stmt, {"t": table})).scalar_one())


async def _until_due(stats: TableStats, want: list[str]) -> list[str]:
    deadline = time.monotonic() + 15
    while (due := await stats.due()) != want and time.monotonic() < deadline:
        await asyncio.sleep(0.2)  # counters are flushed to the shared statistics lazily
    return due


async def test_a_grown_table_is_analyzed_once_and_a_small_change_is_not(postgres_url) -> None:
    await asyncio.to_thread(upgrade, postgres_url)
    engine = make_async_engine(postgres_url)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                insert(Run.__table__),
                [
                    {
                        "id": "r",
                        "name": "r",
                        "model": "tiny",
                        "model_path": "/x",
                        "config": {},
                        "counters": {},
                    }
                ],
            )
        stats = TableStats(engine, min_rows=500, fraction=0.2)
        await _episodes(engine, 0, 100)
        await asyncio.sleep(1.5)
        assert await stats.step() == []  # 100 rows: under 500 + 20 %
        await _episodes(engine, 100, 600)
        assert await _until_due(stats, ["episodes"]) == ["episodes"]
        before = await _analyze_count(engine, "episodes")
        assert await stats.step() == ["episodes"]
        assert await _analyze_count(engine, "episodes") == before + 1
        assert stats.analyzed == {"episodes": 1}
        assert await stats.due() == []  # counted from this analyze on
        await _episodes(engine, 700, 100)  # 100 < 500 + 20 % of 700
        await asyncio.sleep(1.5)
        assert await stats.step() == []
    finally:
        await engine.dispose()


async def test_sqlite_has_nothing_to_analyze(tmp_path) -> None:
    engine = make_async_engine(f"sqlite:///{tmp_path / 's.db'}")
    try:
        stats = TableStats(engine)
        assert not stats.enabled and await stats.step() == []
    finally:
        await engine.dispose()
