"""The group commit's connections skip the WAL-flush wait unless asked; nothing else does.

Real PostgreSQL, the app's own lifespan. `capture_synchronous_commit` off (the
default): the capture engine's connections run with `synchronous_commit=off`,
so an answer waits for its rows to be committed and visible, not for the disk
flush (docs/deployment.md, "Durability of captures"). Every other write (runs,
rewards, keys, steps) stays on the server's setting.
"""

from __future__ import annotations

import pytest
from sqlalchemy import text

from core.settings import Settings
from gateway.app import create_app

pytestmark = pytest.mark.integration


async def _setting(sessions) -> str:
    async with sessions() as s:
        return (await s.execute(text("SHOW synchronous_commit"))).scalar_one()


@pytest.mark.parametrize(("durable", "capture"), [(False, "off"), (True, "on")])
async def test_only_the_capture_connections_skip_the_flush_wait(
    postgres_url: str, tmp_path, durable: bool, capture: str
) -> None:
    settings = Settings(
        data_dir=tmp_path / "data",
        database_url=postgres_url,
        admin_key="commit-admin",
        dev_mode=False,
        capture_synchronous_commit=durable,
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        assert await _setting(app.state.capture.sessions) == capture
        assert await _setting(app.state.sessions) == "on"
