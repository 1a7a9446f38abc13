"""Two hosts starting together migrate a fresh PostgreSQL schema: both succeed, one schema.

Each `upgrade()` runs in its own process, as two gateway hosts would
(`core.store.migrate` takes a PostgreSQL advisory lock around Alembic).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import text

from core.store.db import make_sync_engine
from core.store.migrate import alembic_config
from core.store.models import Base

pytestmark = pytest.mark.integration

PG_URL = "postgresql://postgres@127.0.0.1:5432/test"
UPGRADE = "import sys; from core.store.migrate import upgrade; upgrade(sys.argv[1])"


@pytest.fixture
def fresh_schema() -> Iterator[str]:
    try:
        admin = psycopg.connect(PG_URL, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL must run at {PG_URL} for this test: {exc}")
    schema = "rlgate_lock_" + uuid.uuid4().hex[:10]
    admin.execute(f'CREATE SCHEMA "{schema}"')
    try:
        yield schema
    finally:
        admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        admin.close()


@pytest.mark.parametrize("hosts", [2, 4])
def test_concurrent_upgrades_of_a_fresh_schema_both_succeed(
    fresh_schema: str, hosts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = os.environ | {"PGOPTIONS": f"-c search_path={fresh_schema}"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", UPGRADE, PG_URL],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(hosts)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out[-3000:]

    monkeypatch.setenv("PGOPTIONS", f"-c search_path={fresh_schema}")
    head = ScriptDirectory.from_config(alembic_config(PG_URL)).get_current_head()
    engine = make_sync_engine(PG_URL)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT current_schema()")).scalar_one() == fresh_schema
            versions = conn.execute(text("SELECT version_num FROM alembic_version")).all()
            assert [v for (v,) in versions] == [head]
            assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    finally:
        engine.dispose()
