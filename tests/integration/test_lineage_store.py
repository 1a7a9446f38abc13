"""The placement's reads (`core.store.lineage`) on PostgreSQL and SQLite alike.

Real PostgreSQL (a fresh database per test; there the reads run straight on
psycopg, `core.store.lineage_pg`) and a SQLite file (through ORM sessions).
The parent lookup: the longest matching prefix wins, then the newest, and past
`CANDIDATES` rows the hashes are looked up one at a time with the same answer.
The ancestry: one recursive query, nearest first, bounded. A completion read
back equals, column for column, what the ORM reads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import async_sessionmaker

from core.store import completions as store
from core.store import lineage_pg
from core.store.db import is_postgres, make_async_engine
from core.store.lineage import Lineage
from core.store.migrate import upgrade
from core.store.models import Completion, Episode, Run
from gateway.agent.capture import is_outage
from tests.integration.conftest import migrated_store

pytestmark = pytest.mark.integration

RUN = "run_h"
T0 = datetime(2026, 1, 1, tzinfo=UTC)
SINCE = T0 - timedelta(days=1)


@pytest.fixture(params=["postgresql", "sqlite"])
def db_url(request, tmp_path) -> Iterator[str]:
    with migrated_store(request.param, tmp_path) as url:
        yield url


@pytest.fixture
async def sessions(db_url: str):
    engine = make_async_engine(db_url, 1)
    sm = async_sessionmaker(engine, expire_on_commit=False)
    async with sm.begin() as s:
        s.add(Run(id=RUN, name="h", model="tiny", model_path="/x", config={}, counters={}))
        await s.flush()
        s.add_all([Episode(run_id=RUN, id=e, group_id="g", status="open") for e in ("a", "b")])
    yield sm
    await engine.dispose()


@pytest.fixture
async def lineage(db_url: str, sessions):
    """The reads as the app makes them: on PostgreSQL on the call path's own pool."""
    if not is_postgres(db_url):
        yield Lineage(sessions)
        return
    call = make_async_engine(db_url, 1, autocommit=True)
    yield Lineage(async_sessionmaker(call, expire_on_commit=False))
    await call.dispose()


@pytest.fixture
def small_windows(monkeypatch) -> Iterator[None]:
    """Three candidates at most, and ancestries of at most three completions."""
    monkeypatch.setattr(store, "CANDIDATES", 3)
    monkeypatch.setattr(store, "ANCESTRY_LIMIT", 3)
    store.candidates_stmt.cache_clear()
    lineage_pg._compiled.cache_clear()
    yield
    store.candidates_stmt.cache_clear()
    lineage_pg._compiled.cache_clear()


async def add(
    sm, cid: str, conv_hash: str | None, age_s: float, episode: str = "a", parent: str | None = None
) -> None:
    async with sm.begin() as s:
        s.add(
            Completion(
                id=cid,
                run_id=RUN,
                episode_id=episode,
                parent_id=parent,
                messages=[{"role": "user", "content": f"turn {cid} \u00e9\U0001f600"}],
                prompt_token_ids=[1, 70000, 2**31 - 1],
                output_token_ids=[2, 3],
                output_logprobs=[-0.5, -1.25],
                content="x",
                finish_reason="stop",
                temperature=0.7,
                policy_version=3,
                created_at=T0 - timedelta(seconds=age_s),
                conv_hash=conv_hash,
                spliced=parent is not None,
                tool_calls=[{"id": "c1", "type": "function"}] if parent else None,
            )
        )


async def find(lineage, hashes: dict[str, int], episode: str | None = None) -> str | None:
    found = await lineage.parent(RUN, hashes, SINCE, episode)
    return found.id if found is not None else None


async def test_the_longest_prefix_wins_over_a_newer_shorter_one(sessions, lineage) -> None:
    await add(sessions, "long-old", "h2", age_s=50)
    await add(sessions, "short-new", "h1", age_s=10)
    await add(sessions, "long-new", "h2", age_s=20)
    await add(sessions, "other-episode", "h2", age_s=5, episode="b")
    await add(sessions, "too-old", "h3", age_s=2 * 86400)
    assert await find(lineage, {"h1": 1, "h2": 2}, "a") == "long-new"
    assert await find(lineage, {"h1": 1, "h2": 2}) == "other-episode"  # any episode: newest
    assert await find(lineage, {"h1": 1}, "a") == "short-new"
    assert await find(lineage, {"zz": 1}, "a") is None
    assert await find(lineage, {"h3": 1}, "a") is None  # outside the window
    assert await find(lineage, {}, "a") is None


async def test_past_the_candidate_limit_the_answer_is_the_same(
    sessions, lineage, small_windows
) -> None:
    await add(sessions, "long-old", "h2", age_s=500)
    for i in range(6):  # newer, shorter matches crowd the candidate window
        await add(sessions, f"short-{i}", "h1", age_s=10 + i)
    assert await find(lineage, {"h1": 1, "h2": 2}, "a") == "long-old"
    assert await find(lineage, {"h1": 1, "zz": 2}, "a") == "short-0"
    assert await find(lineage, {"h1": 1, "h2": 2}, "b") is None


async def test_ancestry_is_nearest_first_and_reads_every_column_as_the_orm(
    sessions, lineage
) -> None:
    await add(sessions, "c1", "k1", age_s=40)
    for i in range(2, 6):
        await add(sessions, f"c{i}", f"k{i}", age_s=40 - i, parent=f"c{i - 1}")
    parent = await lineage.parent(RUN, {"k5": 1}, SINCE, "a")
    chain = await lineage.ancestry(parent)
    assert [c.id for c in chain] == ["c5", "c4", "c3", "c2", "c1"]
    columns = [c.key for c in Completion.__table__.columns]
    async with sessions() as s:
        for got in chain:
            want = await s.get(Completion, got.id)
            assert {k: getattr(got, k) for k in columns} == {k: getattr(want, k) for k in columns}
    assert list(chain[0].prompt_token_ids) == [1, 70000, 2**31 - 1]
    assert await lineage.ancestry(chain[-1]) == [chain[-1]]  # a first turn: nothing read
    assert await lineage.ancestry(None) == []


async def test_ancestry_is_bounded(sessions, lineage, small_windows) -> None:
    await add(sessions, "c1", None, age_s=40)
    for i in range(2, 6):
        await add(sessions, f"c{i}", None, age_s=40 - i, parent=f"c{i - 1}")
    async with sessions() as s:
        last = await s.get(Completion, "c5")
    assert [c.id for c in await lineage.ancestry(last)] == ["c5", "c4", "c3"]


async def test_a_dropped_connection_is_an_outage_once_then_replaced(postgres_url: str) -> None:
    """PostgreSQL: a pooled connection the server dropped fails one read with SQLAlchemy's
    OperationalError (the gateway's retryable 503) and is not handed out again."""
    await asyncio.to_thread(upgrade, postgres_url)
    engine = make_async_engine(postgres_url, 1, autocommit=True, ping_after_idle_s=60.0)
    lineage = Lineage(async_sessionmaker(engine, expire_on_commit=False))
    try:
        assert await lineage.parent(RUN, {"h": 1}, SINCE, None) is None
        async with engine.connect() as conn:
            pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
        with psycopg.connect(postgres_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(DBAPIError) as err:
            await lineage.parent(RUN, {"h": 1}, SINCE, None)
        assert is_outage(err.value) and err.value.connection_invalidated
        assert await lineage.parent(RUN, {"h": 1}, SINCE, None) is None
    finally:
        await engine.dispose()


async def test_reads_on_the_main_pool_leave_its_connection_transactional(
    postgres_url: str,
) -> None:
    """PostgreSQL, reads given the main pool (a service built without the call pool): the
    connection is switched to autocommit for the read only; the next ORM transaction on
    it still rolls back."""
    await asyncio.to_thread(upgrade, postgres_url)
    engine = make_async_engine(postgres_url, 1)
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    try:
        assert await Lineage(sessions).parent(RUN, {"h": 1}, SINCE, None) is None
        async with sessions() as s:
            s.add(Run(id="r-rolled-back", name="x", model="tiny", model_path="/x"))
            await s.flush()
            await s.rollback()
        async with sessions() as s:
            assert await s.get(Run, "r-rolled-back") is None
    finally:
        await engine.dispose()
