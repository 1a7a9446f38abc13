"""Per-key rate limits and token quotas against the real Redis on 127.0.0.1:6379.

Each test module uses its own key prefix in Redis, removed afterwards.
"""

from __future__ import annotations

import time
import uuid

import httpx
import pytest
import redis

from rlgate.stack import stop

pytestmark = pytest.mark.integration

REDIS_URL = "redis://127.0.0.1:6379/0"
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def prefix():
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.fail(f"Redis must run on 127.0.0.1:6379: {exc}")
    name = f"rlgate-test-quota-{uuid.uuid4().hex[:8]}:"
    yield name
    for key in client.scan_iter(match=name + "*"):
        client.delete(key)


@pytest.fixture(scope="module")
def server(gateway_launcher, tmp_path_factory, prefix):
    srv = gateway_launcher(
        tmp_path_factory.mktemp("quotas") / "data", quota_redis_url=REDIS_URL, quota_prefix=prefix
    )
    yield srv
    stop(srv.proc)


def _clients(server, run):
    admin = httpx.Client(base_url=server.url, headers=server.admin_headers(), timeout=60)
    agent = httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {run['api_key']}"}, timeout=60
    )
    key_id = admin.get(f"/admin/v1/runs/{run['run_id']}/keys").json()[0]["id"]
    return admin, agent, key_id


def test_requests_per_minute_per_key(server) -> None:
    run = server.create_run(name="rpm")
    admin, agent, key_id = _clients(server, run)
    limits = f"/admin/v1/runs/{run['run_id']}/keys/{key_id}/limits"
    r = admin.put(limits, json={"requests_per_min": 2})
    assert r.status_code == 200 and r.json()["requests_per_min"] == 2
    body = {"model": run["name"], "messages": MSGS, "max_tokens": 2}
    # The limit counts calls in fixed one-minute windows: start the five calls early in one,
    # so that they all land in it and exactly the first two get through.
    if time.time() % 60 > 40:
        time.sleep(60 - time.time() % 60)
    window = int(time.time() // 60)
    answers = [agent.post("/v1/chat/completions", json=body) for _ in range(5)]
    counted = admin.get(limits).json()["requests_this_min"]  # admin calls are never limited
    assert int(time.time() // 60) == window, "the five calls took more than 20 s"
    assert [a.status_code for a in answers] == [200, 200, 429, 429, 429]
    assert counted == 5  # refused calls count too
    over = next(a for a in answers if a.status_code == 429)
    assert 1 <= int(over.headers["retry-after"]) <= 60
    err = over.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
    # another key of the same run has its own budget (and no limits of its own)
    other = admin.post(f"/admin/v1/runs/{run['run_id']}/keys").json()["api_key"]
    headers = {"Authorization": f"Bearer {other}"}
    assert httpx.post(
        server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60
    ).is_success


def test_tokens_per_day(server) -> None:
    run = server.create_run(name="tpd")
    admin, agent, key_id = _clients(server, run)
    limits = f"/admin/v1/runs/{run['run_id']}/keys/{key_id}/limits"
    admin.put(limits, json={"tokens_per_day": 30}).raise_for_status()
    body = {"model": run["name"], "messages": MSGS, "max_tokens": 4}
    first = agent.post("/v1/chat/completions", json=body)
    assert first.status_code == 200
    used = first.json()["usage"]["total_tokens"]
    assert admin.get(limits).json()["tokens_today"] == used
    # a stream with include_usage is counted from its usage chunk
    stream_body = body | {"stream": True, "stream_options": {"include_usage": True}}
    with agent.stream("POST", "/v1/chat/completions", json=stream_body) as s:
        assert s.status_code == 200
        text = "".join(s.iter_text())
    assert '"usage"' in text
    total = admin.get(limits).json()["tokens_today"]
    assert total > used
    assert total >= 30  # both prompts alone exceed the quota of 30
    over = agent.post("/v1/chat/completions", json=body)
    assert over.status_code == 429
    assert over.json()["error"]["code"] == "quota_exceeded"
    assert int(over.headers["retry-after"]) >= 1
    # raising the quota lets the key through at once
    admin.put(limits, json={"tokens_per_day": 10**6}).raise_for_status()
    assert agent.post("/v1/chat/completions", json=body).status_code == 200


def test_limits_validation_and_isolation(server) -> None:
    a, b = server.create_run(name="qa"), server.create_run(name="qb")
    admin, _, key_a = _clients(server, a)
    path = f"/admin/v1/runs/{b['run_id']}/keys/{key_a}/limits"  # A's key under run B
    assert admin.put(path, json={"requests_per_min": 5}).status_code == 404
    good = f"/admin/v1/runs/{a['run_id']}/keys/{key_a}/limits"
    for bad in ({"requests_per_min": 0}, {"tokens_per_day": -1}, {"burst": 3}):
        r = admin.put(good, json=bad)
        assert r.status_code == 400, (bad, r.text)
    agent_b = httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {b['api_key']}"}, timeout=60
    )
    assert agent_b.put(good, json={"requests_per_min": 1}).status_code == 401


def test_quotas_off_without_redis(gateway_server) -> None:
    run = gateway_server.create_run(name="noquota")
    admin, agent, key_id = _clients(gateway_server, run)
    r = admin.put(
        f"/admin/v1/runs/{run['run_id']}/keys/{key_id}/limits", json={"requests_per_min": 1}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "quotas_disabled"
    body = {"model": run["name"], "messages": MSGS, "max_tokens": 2}
    assert all(agent.post("/v1/chat/completions", json=body).status_code == 200 for _ in range(3))


def test_evaluation_calls_are_metered_like_any_other(server) -> None:
    run = server.create_run(name="rpm-eval")
    admin, agent, key_id = _clients(server, run)
    limits = f"/admin/v1/runs/{run['run_id']}/keys/{key_id}/limits"
    assert admin.put(limits, json={"requests_per_min": 2}).status_code == 200
    body = {"model": run["name"], "messages": MSGS, "max_tokens": 2}
    if time.time() % 60 > 40:
        time.sleep(60 - time.time() % 60)
    window = int(time.time() // 60)
    paths = ["/eval/v1/chat/completions", "/v1/chat/completions",
             "/eval/episodes/q/v1/chat/completions", "/eval/v1/messages"]  # fmt: skip
    answers = [agent.post(path, json=body) for path in paths]
    assert int(time.time() // 60) == window, "the calls took more than 20 s"
    assert [a.status_code for a in answers] == [200, 200, 429, 429]
    assert admin.get(limits).json()["requests_this_min"] == 4
