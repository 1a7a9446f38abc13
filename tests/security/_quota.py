"""Helpers of the security tests that meter keys: a real Redis, a key with its own limits."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
import redis

from rlgate.stack import stop

REDIS_URL = "redis://127.0.0.1:6379/5"


def redis_prefix() -> Iterator[str]:
    """A fresh key namespace in the real Redis (a missing Redis fails the test), then removed."""
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.fail(f"Redis must run on 127.0.0.1:6379: {exc}")
    name = f"rlgate-test-sec-{uuid.uuid4().hex[:8]}:"
    yield name
    for key in client.scan_iter(match=name + "*"):
        client.delete(key)


def quota_gateway(launch, tmp_path_factory, name: str) -> Iterator:
    """A real gateway with quotas on, in a fresh Redis namespace; stopped and cleaned after
    (`launch` is the `gateway_launcher` fixture)."""
    for prefix in redis_prefix():
        srv = launch(
            tmp_path_factory.mktemp(name) / "data", quota_redis_url=REDIS_URL, quota_prefix=prefix
        )
        try:
            yield srv
        finally:
            stop(srv.proc)


def admin(server) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers=server.admin_headers(), timeout=60)


def key_id(server, run: dict) -> int:
    with admin(server) as a:
        return a.get(f"/admin/v1/runs/{run['run_id']}/keys").json()[0]["id"]


def set_limits(server, run: dict, kid: int, **limits) -> None:
    with admin(server) as a:
        r = a.put(f"/admin/v1/runs/{run['run_id']}/keys/{kid}/limits", json=limits)
        assert r.status_code == 200, r.text


def quota(server, run: dict, kid: int) -> dict:
    with admin(server) as a:
        return a.get(f"/admin/v1/runs/{run['run_id']}/keys/{kid}/limits").json()


def early_in_a_minute(need_s: float = 25) -> None:
    """Start where `need_s` seconds of calls fit in one fixed one-minute window."""
    if time.time() % 60 > 60 - need_s:
        time.sleep(60 - time.time() % 60 + 0.2)
