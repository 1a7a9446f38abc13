"""The development admin key opens the admin API only to loopback peers, per request.

The app is built by `gateway.app.create_app`, the factory `uvicorn --factory` calls,
which cannot know its bind address: the check is on each request's peer. The peer is
set through `httpx.ASGITransport(client=...)`, so no packet leaves the machine; the
admin API and the dashboard login are exercised, with the app's own lifespan.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from core.settings import DEV_ADMIN_KEY
from gateway.app import create_app
from tests.conftest import gateway_settings

pytestmark = pytest.mark.integration

DEV = {"Authorization": f"Bearer {DEV_ADMIN_KEY}"}


@pytest.fixture
async def dev_app(tmp_path: Path, model_cache_dir: Path) -> AsyncIterator:
    """A gateway app in dev mode with no admin key set: the development key is its credential."""
    settings = gateway_settings(tmp_path / "data", model_cache_dir, admin_key="", dev_mode=True)
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        yield app


def _client(app, peer: str) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, client=(peer, 40000))
    return httpx.AsyncClient(transport=transport, base_url="http://gateway")


@pytest.mark.parametrize("peer", ["10.1.2.3", "192.168.0.7", "2001:db8::1"])
async def test_dev_key_refused_off_loopback(dev_app, peer: str) -> None:
    async with _client(dev_app, peer) as c:
        resp = await c.get("/admin/v1/runs", headers=DEV)
    assert resp.status_code == 401, resp.text
    error = resp.json()["error"]
    assert error["code"] == "dev_admin_key_off_loopback"
    assert "loopback" in error["message"]


@pytest.mark.parametrize("peer", ["127.0.0.1", "127.8.9.10", "::1"])
async def test_dev_key_accepted_on_loopback(dev_app, peer: str) -> None:
    async with _client(dev_app, peer) as c:
        resp = await c.get("/admin/v1/runs", headers=DEV)
    assert resp.status_code == 200, resp.text


async def test_dashboard_login_with_dev_key_refused_off_loopback(dev_app) -> None:
    async with _client(dev_app, "10.1.2.3") as c:
        form = await c.get("/dashboard/login")
        token = form.cookies["rlgate_login_csrf"]
        resp = await c.post(
            "/dashboard/login", data={"admin_key": DEV_ADMIN_KEY, "csrf_token": token}
        )
    assert resp.status_code == 303
    assert "error=" in resp.headers["location"]
    assert "rlgate_session" not in resp.cookies


async def test_a_configured_admin_key_works_from_anywhere(
    tmp_path: Path, model_cache_dir: Path
) -> None:
    settings = gateway_settings(tmp_path / "data", model_cache_dir, admin_key="a-real-admin-key")
    app = create_app(settings)
    async with app.router.lifespan_context(app), _client(app, "10.1.2.3") as c:
        ok = await c.get("/admin/v1/runs", headers={"Authorization": "Bearer a-real-admin-key"})
        dev = await c.get("/admin/v1/runs", headers=DEV)
    assert ok.status_code == 200, ok.text
    assert dev.status_code == 401


async def test_dashboard_session_under_dev_key_refused_off_loopback(dev_app) -> None:
    """A session cookie is signed under the admin key: under the published development key
    anyone can forge one, so it too is honoured only from loopback."""
    cookie, _ = dev_app.state.dashboard_signer.issue()
    async with _client(dev_app, "10.1.2.3") as c:
        c.cookies.set("rlgate_session", cookie, path="/dashboard")
        feed = await c.get("/dashboard/")
    assert feed.status_code == 303 and feed.headers["location"].endswith("/login")
    async with _client(dev_app, "127.0.0.1") as c:
        c.cookies.set("rlgate_session", cookie, path="/dashboard")
        page = await c.get("/dashboard/")
    assert page.status_code == 200
