"""Real processes for integration tests: PostgreSQL databases, Redis queues, a worker, a gateway."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg
import pytest
import redis

from core.settings import Settings
from rlgate.stack import stack_processes

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/test"
REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture(scope="session")
def redis_url() -> str:
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
    except redis.RedisError as exc:
        pytest.fail(f"Redis must run on 127.0.0.1:6379 for integration tests: {exc}")
    return REDIS_URL


@contextlib.contextmanager
def fresh_database() -> Iterator[str]:
    """A new, empty PostgreSQL database (its URL), dropped afterwards."""
    name = "rlgate_it_" + uuid.uuid4().hex[:10]
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql://postgres@127.0.0.1:5432/{name}"
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def migrated_store(kind: str, directory: Path) -> Iterator[str]:
    """A migrated, empty store (its URL): a fresh PostgreSQL database ("postgresql...") or a
    SQLite file in `directory` ("sqlite")."""
    from core.store.migrate import upgrade

    if kind == "sqlite":
        url = f"sqlite:///{directory / 'store.db'}"
        upgrade(url)
        yield url
        return
    with fresh_database() as url:
        upgrade(url)
        yield url


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test."""
    with fresh_database() as url:
        yield url


@pytest.fixture(scope="module")
def module_postgres_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database shared by one test module."""
    with fresh_database() as url:
        yield url


@dataclass
class Stack:
    url: str
    admin_key: str
    settings: Settings

    def admin(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {self.admin_key}"}, timeout=120
        )


@contextlib.contextmanager
def running_stack(settings: Settings, logs: Path) -> Iterator[Stack]:
    with stack_processes(settings, "127.0.0.1", 0, logs) as (url, _, _):
        yield Stack(url, settings.admin_key, settings)


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    from inference.models import resolve_model

    cache = tmp_path_factory.mktemp("models")
    resolve_model("tiny", cache)
    return cache


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory) -> Path:
    """SmolLM2-135M converted once per session (about 10 s), with the hub switched off."""
    from inference.models import resolve_model

    cache = tmp_path_factory.mktemp("smollm2")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")  # prove nothing is fetched
        resolve_model("smollm2", cache)
    return cache
