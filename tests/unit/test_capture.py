"""Group commit of completions: batched, nothing lost, one bad row fails only its request."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import async_sessionmaker

from gateway.errors import Unavailable
from gateway.services.capture import CaptureWriter
from gateway.store.db import make_async_engine
from gateway.store.migrate import upgrade
from gateway.store.models import Completion, Episode, Run
from rlgate.bench_capture import synthetic_row
from rlgate.stack import free_port


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'capture.db'}"
    upgrade(url)
    return url


async def _setup(url: str):
    engine = make_async_engine(url)
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    async with sessions.begin() as s:
        s.add(Run(id="r1", name="r1", model="tiny", model_path="/nowhere"))
    return engine, sessions


async def _count(sessions, model) -> int:
    async with sessions() as s:
        return (await s.execute(select(func.count()).select_from(model))).scalar_one()


def test_concurrent_rows_share_commits_and_all_are_stored(db_url: str) -> None:
    async def main() -> tuple[int, int, int]:
        engine, sessions = await _setup(db_url)
        writer = CaptureWriter(sessions, max_batch=16)
        writer.start()
        rng = random.Random(0)
        rows = [synthetic_row("r1", f"ep-{i % 10}", None, rng) for i in range(60)]
        for row in rows:
            row.link = "header"  # named by the caller: the episode may exist already
        await asyncio.gather(*(writer.submit([r], "g1") for r in rows))
        await writer.close()
        counts = await _count(sessions, Completion), await _count(sessions, Episode)
        await engine.dispose()
        return (*counts, writer.batches)

    completions, episodes, batches = asyncio.run(main())
    assert completions == 60
    assert episodes == 10  # ten episodes, each created once although its rows share batches
    assert 60 / 16 <= batches < 60  # grouped, and no batch above max_batch


def test_one_bad_row_fails_only_its_own_request(db_url: str) -> None:
    async def main():
        engine, sessions = await _setup(db_url)
        rng = random.Random(1)
        first = synthetic_row("r1", "ep-a", None, rng)
        await CaptureWriter(sessions).submit([first], None)  # unstarted: one transaction
        writer = CaptureWriter(sessions)
        writer.start()
        dup = synthetic_row("r1", "ep-b", None, rng)
        dup.id = first.id  # primary key taken: this request must fail, alone
        good = [synthetic_row("r1", f"ep-{i}", None, rng) for i in range(5)]
        results = await asyncio.gather(
            *(writer.submit([r], None) for r in [*good[:2], dup, *good[2:]]),
            return_exceptions=True,
        )
        await writer.close()
        n = await _count(sessions, Completion)
        await engine.dispose()
        return results, n

    results, n = asyncio.run(main())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert len(errors) == 1 and results[2] is errors[0]
    assert n == 1 + 5


def test_database_outage_is_a_retryable_503_for_every_request_of_the_batch() -> None:
    port = free_port()  # nothing listens there: connection refused, as with a stopped server

    async def main():
        engine = make_async_engine(f"postgresql://postgres@127.0.0.1:{port}/none")
        sessions = async_sessionmaker(engine, expire_on_commit=False)
        writer = CaptureWriter(sessions)
        writer.start()
        rng = random.Random(2)
        rows = [synthetic_row("r1", f"ep-{i}", None, rng) for i in range(4)]
        results = await asyncio.gather(
            *(writer.submit([r], None) for r in rows), return_exceptions=True
        )
        # the next call is refused before it samples, while the database stays away
        with pytest.raises(Unavailable) as refused:
            await writer.check()
        assert refused.value.code == "database_unavailable"
        await writer.close()
        await engine.dispose()
        return results

    results = asyncio.run(main())
    assert all(isinstance(r, Unavailable) for r in results), results
    assert {r.status for r in results} == {503}
    assert {r.code for r in results} == {"database_unavailable"}
