"""Isolation for every admin and dashboard resource: agent keys never reach them.

The admin routes are enumerated from the live OpenAPI schema, so a route added
later is covered without editing this file.
"""

from __future__ import annotations

import re

import httpx
import pytest

pytestmark = pytest.mark.integration

MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def runs(gateway_server):
    return gateway_server.create_run(name="acc-a"), gateway_server.create_run(name="acc-b")


def _client(server, key: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=60, follow_redirects=False)


def _admin_operations(server, run_b: str) -> list[tuple[str, str]]:
    schema = httpx.get(server.url + "/openapi.json", timeout=30).json()
    values = {
        "run_id": run_b,
        "key_id": "1",
        "version": "0",
        "episode_id": "e",
        "group_id": "g",
        "action": "pause",
    }
    ops = []
    for path, item in schema["paths"].items():
        if not path.startswith("/admin/"):
            continue
        concrete = re.sub(r"\{(\w+)\}", lambda m: values[m.group(1)], path)
        ops += [(method.upper(), concrete) for method in item if method != "parameters"]
    return ops


def test_every_admin_operation_rejects_agent_keys(gateway_server, runs) -> None:
    a, b = runs
    ops = _admin_operations(gateway_server, b["run_id"])
    # the new resources are in the schema (and so in this test)
    paths = {p for _, p in ops}
    for expected in ("versions", "episodes", "metrics", "counters", "checkpoint", "rollback"):
        assert any(expected in p for p in paths), expected
    assert ("DELETE", f"/admin/v1/runs/{b['run_id']}") in ops
    assert ("GET", "/admin/v1/workers") in ops
    for key in (a["api_key"], b["api_key"], "rlg-made-up", None):
        client = _client(gateway_server, key)
        for method, path in ops:
            r = client.request(method, path, json={})
            assert r.status_code == 401, (method, path, r.status_code)
            body = r.json()["error"]
            assert body["type"] == "authentication_error"
            assert body["code"] == ("missing_api_key" if key is None else "invalid_admin_key")
    # nothing changed for run B
    admin = _client(gateway_server, gateway_server.admin_key)
    info = admin.get(f"/admin/v1/runs/{b['run_id']}").json()
    assert info["status"] == "active" and info["name"] == "acc-b"


def test_dashboard_needs_a_session_not_a_key(gateway_server, runs) -> None:
    a, b = runs
    for key in (a["api_key"], gateway_server.admin_key):  # a bearer header is not a session
        client = _client(gateway_server, key)
        for path in ("/dashboard/", f"/dashboard/runs/{b['run_id']}", "/dashboard/runs/x/keys"):
            r = client.get(path)
            assert r.status_code == 303 and r.headers["location"] == "/dashboard/login"
        assert client.get("/dashboard/api/runs").status_code == 401
        assert client.get(f"/dashboard/api/runs/{b['run_id']}/live").status_code == 401
        r = client.post(f"/dashboard/runs/{b['run_id']}/pause", data={"csrf_token": "x"})
        assert r.status_code == 401
    assert _client(gateway_server).get("/dashboard/static/charts.js").status_code == 200


def test_run_a_key_cannot_read_run_b_responses(gateway_server, runs) -> None:
    a, b = runs
    made = _client(gateway_server, b["api_key"]).post(
        "/v1/responses", json={"model": b["name"], "input": "hi", "max_output_tokens": 2}
    )
    assert made.status_code == 200, made.text
    rid = made.json()["id"]
    assert _client(gateway_server, b["api_key"]).get(f"/v1/responses/{rid}").status_code == 200
    assert _client(gateway_server, a["api_key"]).get(f"/v1/responses/{rid}").status_code == 404
