"""Quotas while their Redis is down: the gateway fails open (docs/admin-api.md says why).

The gateway's quota Redis URL points at a closed loopback port, with a default
limit of one request a minute that a working Redis would enforce from the second
call. Agent calls still succeed and are stored; the limits endpoints answer 503
`quota_store`. Then a real `redis-server` is started on that port and the same
gateway enforces the limit again, without a restart.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
import redis

from rlgate.stack import free_port, stop

if TYPE_CHECKING:
    from tests.conftest import GatewayServer

pytestmark = pytest.mark.integration

MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def redis_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def server(gateway_launcher, tmp_path_factory, redis_port: int) -> Iterator[GatewayServer]:
    srv = gateway_launcher(
        tmp_path_factory.mktemp("quotas-down") / "data",
        quota_redis_url=f"redis://127.0.0.1:{redis_port}/0",
        quota_requests_per_min=1,
    )
    yield srv
    stop(srv.proc)


@pytest.fixture(scope="module")
def run(server: GatewayServer) -> dict:
    return server.create_run(name="quota-down")


def _agent(server: GatewayServer, run: dict) -> httpx.Client:
    headers = {"Authorization": f"Bearer {run['api_key']}"}
    return httpx.Client(base_url=server.url, headers=headers, timeout=60)


def _chat(agent: httpx.Client, run: dict, **fields) -> httpx.Response:
    body = {"model": run["name"], "messages": MSGS, "max_tokens": 2, **fields}
    return agent.post("/v1/chat/completions", json=body)


def test_agent_calls_are_served_and_stored_while_redis_is_down(
    server: GatewayServer, run: dict
) -> None:
    with _agent(server, run) as agent:
        ids, took = [], []
        for _ in range(4):  # a working Redis would answer 429 from the second call
            t0 = time.perf_counter()
            resp = _chat(agent, run)
            took.append(time.perf_counter() - t0)
            assert resp.status_code == 200, resp.text
            ids.append(resp.json()["id"])
        with agent.stream(
            "POST",
            "/v1/chat/completions",
            json={"model": run["name"], "messages": MSGS, "max_tokens": 2, "stream": True},
        ) as stream:
            assert stream.status_code == 200
            assert stream.read().rstrip().endswith(b"data: [DONE]")
        reward = agent.post("/v1/rewards", json={"completion_id": ids[0], "reward": 1.0})
        assert reward.status_code == 200, reward.text
    stored = server.query(
        f"SELECT COUNT(*) FROM completions WHERE id IN ({','.join('?' * len(ids))})", tuple(ids)
    )
    assert stored == [(len(ids),)]
    # A refused connection fails at once: the outage adds no timeout to the call.
    assert min(took) < 2.0, took
    assert "skipped, Redis unavailable" in server.log_text()


def test_limits_endpoints_answer_503(server: GatewayServer, run: dict) -> None:
    admin = httpx.Client(base_url=server.url, headers=server.admin_headers(), timeout=30)
    with admin:
        key_id = admin.get(f"/admin/v1/runs/{run['run_id']}/keys").json()[0]["id"]
        path = f"/admin/v1/runs/{run['run_id']}/keys/{key_id}/limits"
        for resp in (admin.get(path), admin.put(path, json={"requests_per_min": 5})):
            assert resp.status_code == 503, resp.text
            assert resp.json() == {
                "error": {
                    "message": "the quota store (Redis) is unreachable",
                    "type": "service_unavailable",
                    "param": None,
                    "code": "quota_store",
                }
            }


def test_limits_hold_again_once_redis_is_back(
    server: GatewayServer, run: dict, redis_port: int, tmp_path: Path
) -> None:
    binary = shutil.which("redis-server")
    assert binary, "redis-server must be installed for this test"
    args = ["--port", str(redis_port), "--bind", "127.0.0.1", "--save", ""]
    args += ["--appendonly", "no", "--dir", str(tmp_path)]
    proc = subprocess.Popen(
        [binary, *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        client = redis.Redis(port=redis_port, socket_connect_timeout=1)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.1)
        with _agent(server, run) as agent:
            # The minute's window may roll over between the calls; three calls within one
            # window, or two within the next, still show the limit of one.
            codes = [_chat(agent, run).status_code for _ in range(3)]
        assert codes[0] == 200 and 429 in codes, codes
    finally:
        stop(proc)
