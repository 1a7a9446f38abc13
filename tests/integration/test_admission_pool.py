"""Admission's count never asks the pool for a second connection while its caller holds one.

Real PostgreSQL, a pool of one connection (no overflow, as the gateway's pool has none):
the run-status read counts the store on the session it already holds. Asking for another
connection there starved the pool under load (every status request holding one, each
waiting for one more), found by the CI run of `test_concurrent_streaming_agents_...`.
"""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import insert
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from core.store.db import normalize_url
from core.store.migrate import upgrade
from core.store.models import Episode, Run
from gateway.control.admission import Admission
from trainer.config import RunConfig

pytestmark = pytest.mark.integration


async def test_usage_counts_on_the_callers_session_with_a_pool_of_one(postgres_url) -> None:
    await asyncio.to_thread(upgrade, postgres_url)
    engine = create_async_engine(
        normalize_url(postgres_url, asynchronous=True),
        pool_size=1,
        max_overflow=0,
        pool_timeout=3,
    )
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    cfg = RunConfig(max_pending_episodes=100)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                insert(Run.__table__),
                [{"id": "r", "name": "r", "model": "tiny", "model_path": "/x",
                  "config": cfg.model_dump(), "counters": {}}],
            )  # fmt: skip
            await conn.execute(
                insert(Episode.__table__),
                [{"run_id": "r", "id": "e", "group_id": "g", "status": "open"}],
            )
        admission = Admission(sessions)

        async def status() -> int:
            async with sessions() as s:  # the caller holds the pool's only connection
                run = await s.get(Run, "r")
                return (await admission.usage(s, run, cfg)).in_use

        assert await asyncio.gather(*(status() for _ in range(4))) == [1, 1, 1, 1]
    finally:
        await engine.dispose()
