"""Group commit of completions: a database outage is a retryable 503 for every request.

Batching, one bad row and reopening are in tests/integration/test_capture_store.py, on
PostgreSQL and SQLite.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from sqlalchemy.ext.asyncio import async_sessionmaker

from core.store.db import make_async_engine
from gateway.agent.capture import CaptureWriter
from gateway.errors import Unavailable
from rlgate.seed_rows import synthetic_row
from rlgate.stack import free_port


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


def test_close_writes_what_waits_behind_an_inflight_batch_and_returns() -> None:
    """Rows queued behind a batch still in flight when the gateway stops are written, and
    the stop does not hang (it used to when the last batch emptied the queue after the
    stop was asked). The commit is stubbed: no database needed to show the order."""

    async def main() -> tuple[list[str], list[str]]:
        writer = CaptureWriter(async_sessionmaker())
        in_flight, release = asyncio.Event(), asyncio.Event()
        committed: list[str] = []

        async def commit(batch) -> None:
            if not in_flight.is_set():
                in_flight.set()
                await release.wait()
            committed.extend(row.id for item in batch for row in item.rows)

        writer._commit = commit
        writer.start()
        rng = random.Random(4)
        first, second = (synthetic_row("r1", f"ep-{i}", None, rng) for i in range(2))
        submitted = [asyncio.create_task(writer.submit([first], None))]
        await in_flight.wait()
        submitted.append(asyncio.create_task(writer.submit([second], None)))
        await asyncio.sleep(0)  # queued behind the batch in flight
        closing = asyncio.create_task(writer.close())
        await asyncio.sleep(0)
        release.set()
        await asyncio.wait_for(asyncio.gather(closing, *submitted), 5.0)
        return committed, [first.id, second.id]

    committed, submitted = asyncio.run(main())
    assert committed == submitted
