"""Group commit of completions: a database outage is a retryable 503 for every request.

Batching, one bad row and reopening are in tests/integration/test_capture_store.py, on
PostgreSQL and SQLite.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from sqlalchemy.ext.asyncio import async_sessionmaker

from gateway.errors import Unavailable
from gateway.services.capture import CaptureWriter
from gateway.store.db import make_async_engine
from rlgate.bench_capture import synthetic_row
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
