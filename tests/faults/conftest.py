"""Real processes for the fault suite: a restartable gateway, a fresh PostgreSQL database.

Short settings (CI): agents and load times come from RLGATE_FAULT_* variables,
with defaults that keep the whole suite within a few minutes on 2 cores.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from core.settings import Settings
from rlgate.stack import free_port, start_gateway, stop, wait_healthy

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/test"
ADMIN_KEY = "faults-admin"


NO_ADMISSION_CAP = 10**6


def knob(name: str, default: float) -> float:
    """A load setting: RLGATE_FAULT_<NAME> overrides the short CI default."""
    return float(os.environ.get(f"RLGATE_FAULT_{name.upper()}", default))


@pytest.fixture
def pg_database() -> Iterator[tuple[str, str]]:
    """(database name, URL) of a fresh PostgreSQL database, dropped afterwards."""
    name = "rlgate_fault_" + uuid.uuid4().hex[:10]
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield name, f"postgresql://postgres@127.0.0.1:5432/{name}"
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def pg_rows(url: str, sql: str, params: tuple = ()) -> list[tuple]:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(sql, params).fetchall()


@dataclass
class Gateway:
    """A gateway child process that the test can kill -9 and start again on the same port."""

    settings: Settings
    log: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120) -> Gateway:
        self.proc = start_gateway(self.settings, "127.0.0.1", self.port, self.log)
        try:
            wait_healthy(self.url, self.proc, timeout_s=timeout_s)
        except BaseException:
            self.stop()
            raise RuntimeError("gateway did not start:\n" + self.log_text()[-4000:]) from None
        return self

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()  # SIGKILL: no lifespan shutdown, no flush
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def admin(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=120
        )

    def create_run(self, name: str, config: dict[str, Any] | None = None, **extra: Any) -> dict:
        # The fault suites drive hundreds of conversations that nothing trains: staleness-aware
        # admission would hold them once 64 are open, so these runs lift its cap.
        config = {"max_pending_episodes": NO_ADMISSION_CAP, **(config or {})}
        with self.admin() as admin:
            resp = admin.post(
                "/admin/v1/runs",
                json={"name": name, "model": "tiny", "config": config, **extra},
            )
        assert resp.status_code == 201, resp.text
        return resp.json()


def fault_settings(tmp_path: Path, model_cache_dir: Path, **overrides: Any) -> Settings:
    fields: dict[str, Any] = {
        "data_dir": tmp_path / "data",
        "database_url": "",
        "broker_url": "",
        "result_backend": "",
        "public_url": "",
        "admin_key": ADMIN_KEY,
        "dev_mode": False,
        "model_cache_dir": model_cache_dir,
    }
    return Settings(**(fields | overrides))


@pytest.fixture
def make_gateway(tmp_path: Path, model_cache_dir: Path, tiny_model_dir: Path):
    """`make_gateway(**settings)` -> a started Gateway, stopped after the test."""
    started: list[Gateway] = []

    def make(**overrides: Any) -> Gateway:
        settings = fault_settings(tmp_path, model_cache_dir, **overrides)
        gw = Gateway(settings, tmp_path / f"gateway{len(started)}.log")
        started.append(gw)
        return gw.start()

    yield make
    for gw in started:
        gw.stop()


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")
