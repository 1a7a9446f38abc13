"""The gateway's pool pings a connection only after it idled (`core.store.db`).

Real PostgreSQL. A connection used a moment ago goes out unchecked (a ping per
checkout was one of the two round trips of a chat call's placement read); one
that idled past the window is pinged and, if the server dropped it, replaced
before any query sees it. One dropped inside the window fails its query once
(the gateway answers that with a retryable 503) and the pool then recovers.
"""

from __future__ import annotations

import asyncio

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from core.store.db import make_async_engine

pytestmark = pytest.mark.integration


def _counting_pings(engine) -> list[int]:
    dialect, calls = engine.sync_engine.dialect, []
    real = dialect.do_ping

    def ping(dbapi_connection) -> bool:
        calls.append(1)
        return real(dbapi_connection)

    dialect.do_ping = ping
    return calls


async def _pid(engine) -> int:
    async with engine.connect() as conn:
        return (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()


def _terminate(url: str, pid: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))


async def test_only_a_connection_that_idled_is_pinged(postgres_url: str) -> None:
    for idle_s, pinged in ((60.0, False), (0.0, True)):
        engine = make_async_engine(postgres_url, 2, ping_after_idle_s=idle_s)
        calls = _counting_pings(engine)
        try:
            for _ in range(10):
                await _pid(engine)
        finally:
            await engine.dispose()
        # the first checkout opens the connection: nothing to ping
        assert len(calls) == (9 if pinged else 0)


async def test_a_connection_dropped_while_idle_is_replaced_before_use(postgres_url: str) -> None:
    engine = make_async_engine(postgres_url, 1, ping_after_idle_s=0.2)
    try:
        first = await _pid(engine)
        await asyncio.to_thread(_terminate, postgres_url, first)
        await asyncio.sleep(0.3)
        assert await _pid(engine) != first  # no error reached the caller
    finally:
        await engine.dispose()


async def test_a_connection_dropped_inside_the_window_fails_once(postgres_url: str) -> None:
    engine = make_async_engine(postgres_url, 1, ping_after_idle_s=60.0)
    try:
        first = await _pid(engine)
        await asyncio.to_thread(_terminate, postgres_url, first)
        with pytest.raises(DBAPIError) as err:
            await _pid(engine)
        assert err.value.connection_invalidated
        assert await _pid(engine) != first
    finally:
        await engine.dispose()
