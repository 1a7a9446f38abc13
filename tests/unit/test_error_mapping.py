"""Two failures that are the load's or a swap's, not a bug: each a retryable 4xx/5xx, never a 500.

- A pinned call a swap overtook (`VersionMoved`, raised where a backend admits it) is a
  409 `version_moved`, which the openai and anthropic SDKs retry by default.
- A request that waited past the pool's timeout for a database connection (SQLAlchemy's
  pool `TimeoutError`, raised here by a real pool on the real PostgreSQL whose only
  connection the test holds) is a 503 `database_busy`, through the app's own handlers.
"""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import text

from core.store.db import make_async_engine
from gateway.errors import backend_failure, install_error_handlers
from inference.backend import VersionMoved

PG_URL = "postgresql://postgres@127.0.0.1:5432/test"


def test_a_pin_a_swap_overtook_is_a_retryable_409() -> None:
    err = backend_failure(VersionMoved("serves v1, not v0"))
    assert err.status == 409
    assert err.body()["error"]["code"] == "version_moved"
    assert "serves v1, not v0" in err.body()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/rewards", "/v1/messages"], ids=["openai", "anthropic"])
async def test_a_request_that_waited_past_the_pool_timeout_is_a_503(path: str) -> None:
    engine = make_async_engine(PG_URL, pool_size=1, pool_timeout_s=0.2, pre_ping=False)
    app = FastAPI()
    install_error_handlers(app)

    @app.post(path)
    async def _uses_the_database() -> dict:
        async with engine.connect() as conn:
            return {"one": (await conn.execute(text("SELECT 1"))).scalar_one()}

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            assert (await client.post(path)).json() == {"one": 1}  # the pool works
            async with engine.connect() as held:  # the pool's only connection
                await held.execute(text("SELECT 1"))
                resp = await client.post(path)
            assert (await client.post(path)).status_code == 200  # free again: served
    finally:
        await engine.dispose()
    assert resp.status_code == 503, resp.text
    body = resp.json()
    if path == "/v1/messages":
        assert body["type"] == "error" and body["error"]["type"] == "api_error", body
    else:
        assert body["error"]["code"] == "database_busy", body
