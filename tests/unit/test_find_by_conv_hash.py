"""The parent lookup: the longest matching prefix wins, then the newest; on a real SQLite store.

Candidates are read with one prebuilt statement and ranked in Python; past `_CANDIDATES`
rows the ranking falls back to SQL. Both paths must give the same answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.store import completions as store
from gateway.store.db import make_async_engine
from gateway.store.migrate import upgrade
from gateway.store.models import Completion, Episode, Run

RUN = "run_h"
T0 = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.fixture
async def sessions(tmp_path: Path) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    url = f"sqlite:///{tmp_path / 'hash.db'}"
    await asyncio.to_thread(upgrade, url)
    engine = make_async_engine(url)
    sm = async_sessionmaker(engine, expire_on_commit=False)
    async with sm.begin() as s:
        s.add(Run(id=RUN, name="h", model="tiny", model_path="/x", config={}, counters={}))
        await s.flush()
        s.add_all([Episode(run_id=RUN, id=e, group_id="g", status="open") for e in ("a", "b")])
    yield sm
    await engine.dispose()


async def add(sm, cid: str, conv_hash: str, age_s: float, episode: str = "a") -> None:
    async with sm.begin() as s:
        s.add(
            Completion(
                id=cid,
                run_id=RUN,
                episode_id=episode,
                messages=[],
                prompt_token_ids=[1],
                output_token_ids=[2],
                output_logprobs=[-0.5],
                content="x",
                finish_reason="stop",
                temperature=1.0,
                policy_version=0,
                created_at=T0 - timedelta(seconds=age_s),
                conv_hash=conv_hash,
            )
        )


async def find(sm, hashes: dict[str, int], episode: str | None = None) -> str | None:
    async with sm() as s:
        found = await store.find_by_conv_hash(s, RUN, hashes, T0 - timedelta(days=1), episode)
    return found.id if found is not None else None


async def test_the_longest_prefix_wins_over_a_newer_shorter_one(sessions) -> None:
    await add(sessions, "long-old", "h2", age_s=50)
    await add(sessions, "short-new", "h1", age_s=10)
    await add(sessions, "long-new", "h2", age_s=20)
    await add(sessions, "other-episode", "h2", age_s=5, episode="b")
    assert await find(sessions, {"h1": 1, "h2": 2}, "a") == "long-new"
    assert await find(sessions, {"h1": 1, "h2": 2}) == "other-episode"  # any episode: newest
    assert await find(sessions, {"h1": 1}, "a") == "short-new"
    assert await find(sessions, {"zz": 1}, "a") is None
    assert await find(sessions, {}, "a") is None


async def test_past_the_candidate_limit_sql_ranks_and_the_answer_is_the_same(
    sessions, monkeypatch
) -> None:
    await add(sessions, "long-old", "h2", age_s=500)
    for i in range(6):  # newer, shorter matches crowd the candidate window
        await add(sessions, f"short-{i}", "h1", age_s=10 + i)
    assert await find(sessions, {"h1": 1, "h2": 2}, "a") == "long-old"  # Python ranking
    monkeypatch.setattr(store, "_CANDIDATES", 3)
    store._candidates_stmt.cache_clear()
    try:
        assert await find(sessions, {"h1": 1, "h2": 2}, "a") == "long-old"  # SQL ranking
    finally:
        store._candidates_stmt.cache_clear()
