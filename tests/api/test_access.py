"""Isolation and key management: a run's key reaches only its run; keys revoke at once."""

from __future__ import annotations

import sqlite3
import time
from datetime import UTC, datetime

import httpx
import openai
import pytest

pytestmark = pytest.mark.integration

MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def two_runs(gateway_server):
    a = gateway_server.create_run(name="iso-a")
    b = gateway_server.create_run(name="iso-b")
    return a, b


def _http(server, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_a_key_reaches_only_its_own_run(gateway_server, two_runs) -> None:
    a, b = two_runs
    http_a, http_b = _http(gateway_server, a["api_key"]), _http(gateway_server, b["api_key"])
    done_b = http_b.post(
        "/episodes/b-ep/v1/chat/completions",
        json={"model": b["name"], "messages": MSGS, "max_tokens": 2},
    ).json()
    before = gateway_server.count("rewards")
    # run B's model, completion and episode do not exist for run A's key
    assert (
        http_a.post(
            "/v1/chat/completions", json={"model": b["name"], "messages": MSGS, "max_tokens": 2}
        ).status_code
        == 404
    )
    assert (
        http_a.post("/v1/rewards", json={"completion_id": done_b["id"], "reward": 1.0}).status_code
        == 404
    )
    assert http_a.post("/v1/rewards", json={"episode_id": "b-ep", "reward": 1.0}).status_code == 404
    assert gateway_server.count("rewards") == before
    # calling "b-ep" with A's key makes A's own episode of that name, never B's
    mine = http_a.post(
        "/episodes/b-ep/v1/chat/completions",
        json={"model": a["name"], "messages": MSGS, "max_tokens": 2},
    ).json()
    rows = gateway_server.query("SELECT run_id FROM episodes WHERE id = 'b-ep' ORDER BY run_id")
    assert sorted(r[0] for r in rows) == sorted([a["run_id"], b["run_id"]])
    assert gateway_server.completion(mine["id"])["run_id"] == a["run_id"]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/admin/v1/runs"),
        ("POST", "/admin/v1/runs"),
        ("GET", "/admin/v1/runs/{b}"),
        ("GET", "/admin/v1/runs/{b}/keys"),
        ("POST", "/admin/v1/runs/{b}/pause"),
        ("GET", "/admin/v1/runs/{b}/export"),
    ],
)
def test_admin_endpoints_reject_agent_keys(gateway_server, two_runs, method, path) -> None:
    a, b = two_runs
    resp = _http(gateway_server, a["api_key"]).request(method, path.format(b=b["run_id"]), json={})
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_admin_key"


def test_revoke_and_rotate(gateway_server) -> None:
    run = gateway_server.create_run(name="keys")
    admin = _http(gateway_server, gateway_server.admin_key)
    keys = admin.get(f"/admin/v1/runs/{run['run_id']}/keys").json()
    assert len(keys) == 1 and run["api_key"].startswith(keys[0]["prefix"])
    assert "api_key" not in keys[0]  # only the prefix is ever shown again
    client = openai.OpenAI(base_url=run["base_url"], api_key=run["api_key"])
    client.chat.completions.create(model=run["name"], messages=MSGS, max_tokens=2)
    rotated = admin.post(f"/admin/v1/runs/{run['run_id']}/keys/{keys[0]['id']}/rotate").json()
    with pytest.raises(openai.AuthenticationError):  # the old key stops at once
        client.chat.completions.create(model=run["name"], messages=MSGS, max_tokens=2)
    fresh = openai.OpenAI(base_url=run["base_url"], api_key=rotated["api_key"])
    fresh.chat.completions.create(model=run["name"], messages=MSGS, max_tokens=2)
    admin.post(f"/admin/v1/runs/{run['run_id']}/keys/{rotated['id']}/revoke").raise_for_status()
    with pytest.raises(openai.AuthenticationError):
        fresh.chat.completions.create(model=run["name"], messages=MSGS, max_tokens=2)
    # keys are stored hashed: the plaintext is nowhere in the store
    stored = gateway_server.query("SELECT key_hash FROM api_keys")
    assert all(rotated["api_key"] not in row[0] for row in stored)


def test_a_key_revoked_by_another_process_stops_within_the_cache_ttl(gateway_server) -> None:
    """Another gateway process (here: a write straight to the store) revokes the key; this
    gateway, which cached the key's run at the first call, refuses it once the TTL (1 s) passed.
    """
    run = gateway_server.create_run(name="elsewhere")
    agent = _http(gateway_server, run["api_key"])
    body = {"model": run["name"], "messages": MSGS, "max_tokens": 2}
    assert agent.post("/v1/chat/completions", json=body).status_code == 200  # cached now
    with sqlite3.connect(gateway_server.db_path) as conn:
        conn.execute(
            "UPDATE api_keys SET revoked_at = ? WHERE run_id = ?",
            (datetime.now(UTC).isoformat(), run["run_id"]),
        )
    time.sleep(1.5)
    r = agent.post("/v1/chat/completions", json=body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_pause_resume_stop(gateway_server) -> None:
    run = gateway_server.create_run(name="lifecycle")
    admin = _http(gateway_server, gateway_server.admin_key)
    agent = _http(gateway_server, run["api_key"])
    body = {"model": run["name"], "messages": MSGS, "max_tokens": 2}
    assert admin.post(f"/admin/v1/runs/{run['run_id']}/pause").json()["status"] == "paused"
    assert agent.post("/v1/chat/completions", json=body).status_code == 429
    assert admin.post(f"/admin/v1/runs/{run['run_id']}/pause").status_code == 409
    assert admin.post(f"/admin/v1/runs/{run['run_id']}/resume").json()["status"] == "active"
    assert agent.post("/v1/chat/completions", json=body).status_code == 200
    assert admin.post(f"/admin/v1/runs/{run['run_id']}/stop").json()["status"] == "stopped"
    assert agent.post("/v1/chat/completions", json=body).status_code == 429
    assert admin.post(f"/admin/v1/runs/{run['run_id']}/resume").status_code == 409
    assert admin.post(f"/admin/v1/runs/{run['run_id']}/explode").status_code == 404
