"""The group commit's writes on PostgreSQL (one statement or one pipeline per batch) and
SQLite alike.

Real PostgreSQL (a fresh database per test) and a SQLite file. A batch reads
nothing before it writes: episodes go in with ON CONFLICT DO NOTHING, and a
rewarded episode given a new turn is reopened by one UPDATE, so on PostgreSQL
a batch is one round trip (`core.store.capture_pg`): a small batch one
statement, a larger one a pipeline. Every PostgreSQL test runs with each form
for every batch size.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import async_sessionmaker

from core.store import capture_pg
from core.store.db import is_postgres, make_async_engine
from core.store.models import Completion, Episode, Reward, Run
from core.store.status import EpisodeStatus
from gateway.agent.capture import CaptureWriter
from rlgate.seed_rows import synthetic_row
from tests.integration.conftest import migrated_store

pytestmark = pytest.mark.integration


@pytest.fixture(params=["postgresql-one-statement", "postgresql-pipeline", "sqlite"])
def db_url(request, tmp_path, monkeypatch) -> Iterator[str]:
    if request.param.endswith("one-statement"):
        monkeypatch.setattr(capture_pg, "ONE_STATEMENT_ROWS", 1000)
    elif request.param.endswith("pipeline"):
        monkeypatch.setattr(capture_pg, "ONE_STATEMENT_ROWS", 0)
    with migrated_store(request.param, tmp_path) as url:
        yield url


async def _setup(url: str):
    engine = make_async_engine(url)
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    async with sessions.begin() as s:
        s.add(Run(id="r1", name="r1", model="tiny", model_path="/nowhere"))
    return engine, sessions


def _writer(url: str, **kw) -> CaptureWriter:
    """The writer as the app builds it: on PostgreSQL the call path's pool (one connection
    here, so a batch that failed hands the next one the same connection, which goes back
    to the pool unreset), on SQLite the store's own engine."""
    engine = make_async_engine(url, 1, pre_ping=is_postgres(url), autocommit=True)
    return CaptureWriter(async_sessionmaker(engine, expire_on_commit=False), **kw)


async def _count(sessions, model) -> int:
    async with sessions() as s:
        return (await s.execute(select(func.count()).select_from(model))).scalar_one()


async def test_batched_rows_are_all_stored_and_each_episode_once(db_url: str) -> None:
    engine, sessions = await _setup(db_url)
    try:
        async with sessions.begin() as s:  # stored by an earlier turn, in another group
            s.add(Episode(run_id="r1", id="ep-0", group_id="older", status="open"))
        writer = _writer(db_url, max_batch=16)
        writer.start()
        rng = random.Random(0)
        rows = [synthetic_row("r1", f"ep-{i % 10}", None, rng) for i in range(60)]
        for row in rows:
            row.link = "header"  # named by the caller: the episode may exist already
        await asyncio.gather(*(writer.submit([r], "g1") for r in rows))
        await writer.close()
        assert await _count(sessions, Completion) == 60
        assert await _count(sessions, Episode) == 10
        assert 60 / 16 <= writer.batches < 60  # grouped, no batch above max_batch
        async with sessions() as s:
            kept = await s.get(Episode, ("r1", "ep-0"))
            assert kept.group_id == "older"  # an existing episode keeps its group
            assert (await s.get(Episode, ("r1", "ep-1"))).group_id == "g1"
    finally:
        await engine.dispose()


async def test_one_bad_row_fails_only_its_own_request(db_url: str) -> None:
    engine, sessions = await _setup(db_url)
    try:
        rng = random.Random(1)
        first = synthetic_row("r1", "ep-a", None, rng)
        await _writer(db_url).submit([first], None)
        writer = _writer(db_url)
        writer.start()
        dup = synthetic_row("r1", "ep-b", None, rng)
        dup.id = first.id  # primary key taken: this request must fail, alone
        good = [synthetic_row("r1", f"ep-{i}", None, rng) for i in range(5)]
        results = await asyncio.gather(
            *(writer.submit([r], None) for r in [*good[:2], dup, *good[2:]]),
            return_exceptions=True,
        )
        await writer.close()
        errors = [r for r in results if isinstance(r, BaseException)]
        assert len(errors) == 1 and results[2] is errors[0]
        assert await _count(sessions, Completion) == 1 + 5
        assert await _count(sessions, Episode) == 1 + 5  # not ep-b: nothing half-written
    finally:
        await engine.dispose()


async def test_a_new_turn_reopens_only_an_episode_rewarded_turn_by_turn(db_url: str) -> None:
    engine, sessions = await _setup(db_url)
    try:
        async with sessions.begin() as s:
            for ep in ("per-turn", "whole"):
                s.add(Episode(run_id="r1", id=ep, group_id="g", status="rewarded", reward=1.0))
            s.add(Reward(run_id="r1", episode_id="whole", value=1.0))  # an episode reward
        rng = random.Random(2)
        rows = [synthetic_row("r1", ep, None, rng) for ep in ("per-turn", "whole")]
        for row in rows:
            row.link = "path"
        await _writer(db_url).submit(rows, None)
        async with sessions() as s:
            reopened = await s.get(Episode, ("r1", "per-turn"))
            assert (reopened.status, reopened.reward) == (EpisodeStatus.OPEN, None)
            assert (await s.get(Episode, ("r1", "whole"))).status == EpisodeStatus.REWARDED
    finally:
        await engine.dispose()


async def test_a_row_is_stored_as_the_orm_reads_it_back(db_url: str) -> None:
    """What the writer stored reads back through the ORM as the row that was submitted."""
    engine, sessions = await _setup(db_url)
    try:
        row = synthetic_row("r1", "ep-x", None, random.Random(3))
        row.tool_calls = [{"id": "c1", "type": "function", "function": {"name": "f"}}]
        row.reasoning_content = "thought \u00e9\U0001f600"
        row.prompt_token_ids = [0, 1, 2**31 - 1]
        await _writer(db_url).submit([row], "g")
        columns = [c.key for c in Completion.__table__.columns]
        async with sessions() as s:
            got = await s.get(Completion, row.id)
            for name in columns:
                want, have = getattr(row, name), getattr(got, name)
                if name == "created_at":
                    want, have = want.replace(tzinfo=None), have.replace(tzinfo=None)
                elif name == "output_logprobs":  # stored as float32
                    want, have = pytest.approx(list(want), rel=1e-6), list(have)
                elif name.endswith("_ids"):
                    want, have = list(want), list(have)
                assert have == want, name
    finally:
        await engine.dispose()
