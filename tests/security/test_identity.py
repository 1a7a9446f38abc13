"""One caller identity: a key is limited the same whatever header carried it.

A real gateway with quotas on (real Redis): a key limited to 3 requests a minute
makes 8 calls and gets no more than 3 answers, over each header form and endpoint
family; two different keys in one request are a 401 in the family's error shape;
rate-limited answers carry OpenAI's `x-ratelimit-*` headers; a rotated key keeps
its limits.
"""

from __future__ import annotations

import httpx
import pytest

from tests.security._quota import (
    admin,
    early_in_a_minute,
    key_id,
    quota,
    quota_gateway,
    set_limits,
)

pytestmark = pytest.mark.integration

MSGS = [{"role": "user", "content": "hi"}]
ANTHROPIC = {"anthropic-version": "2023-06-01"}


@pytest.fixture(scope="module")
def server(gateway_launcher, tmp_path_factory):
    yield from quota_gateway(gateway_launcher, tmp_path_factory, "identity")


def _limited_run(server, name: str, rpm: int = 3) -> dict:
    run = server.create_run(name=name)
    set_limits(server, run, key_id(server, run), requests_per_min=rpm)
    return run


def _eight(server, path: str, body: dict, headers) -> list[httpx.Response]:
    early_in_a_minute()
    with httpx.Client(base_url=server.url, timeout=60) as c:
        return [c.post(path, json=body, headers=headers) for _ in range(8)]


def _assert_limited(answers: list[httpx.Response], refused=(429,)) -> None:
    codes = [a.status_code for a in answers]
    assert codes.count(200) <= 3, codes
    assert all(c in (200, *refused) for c in codes), codes
    assert len(codes) - codes.count(200) >= 5, codes


def test_x_api_key_is_limited_like_bearer(server) -> None:
    run = _limited_run(server, "xkey")
    body = {"model": run["name"], "messages": MSGS, "max_tokens": 2}
    answers = _eight(server, "/v1/chat/completions", body, {"x-api-key": run["api_key"]})
    _assert_limited(answers)
    ok = answers[0]
    assert ok.status_code == 200
    assert ok.headers["x-ratelimit-limit-requests"] == "3"
    assert ok.headers["x-ratelimit-remaining-requests"] == "2"
    assert ok.headers["x-ratelimit-reset-requests"].endswith("s")
    over = answers[-1]
    assert over.headers["x-ratelimit-remaining-requests"] == "0"
    assert over.json()["error"]["code"] == "rate_limit_exceeded"


def test_a_second_junk_authorization_header_escapes_nothing(server) -> None:
    run = _limited_run(server, "twoauth")
    body = {"model": run["name"], "messages": MSGS, "max_tokens": 2}
    headers = [("authorization", f"Bearer {run['api_key']}"), ("authorization", "Bearer junk")]
    answers = _eight(server, "/v1/chat/completions", body, headers)
    _assert_limited(answers, refused=(401, 429))
    assert {a.json()["error"]["code"] for a in answers} == {"conflicting_api_keys"}


def test_a_repeated_authorization_header_is_one_key_and_metered(server) -> None:
    run = _limited_run(server, "sameauth")
    body = {"model": run["name"], "messages": MSGS, "max_tokens": 2}
    bearer = f"Bearer {run['api_key']}"
    answers = _eight(server, "/v1/chat/completions", body, [("authorization", bearer)] * 2)
    _assert_limited(answers)


def test_messages_are_limited(server) -> None:
    run = _limited_run(server, "msgs")
    body = {"model": run["name"], "messages": MSGS, "max_tokens": 2}
    answers = _eight(server, "/v1/messages", body, {"x-api-key": run["api_key"], **ANTHROPIC})
    _assert_limited(answers)
    over = answers[-1].json()
    assert over["type"] == "error" and over["error"]["type"] == "rate_limit_error"


def test_streamed_responses_are_limited(server) -> None:
    run = _limited_run(server, "resp")
    body = {"model": run["name"], "input": "hi", "max_output_tokens": 2, "stream": True}
    answers = _eight(server, "/v1/responses", body, {"x-api-key": run["api_key"]})
    _assert_limited(answers)


def test_conflicting_keys_are_a_401_in_the_family_shape(server) -> None:
    run = server.create_run(name="conflict")
    other = server.create_run(name="conflict-2")
    both = {"Authorization": f"Bearer {run['api_key']}", "x-api-key": other["api_key"]}
    chat = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": run["name"], "messages": MSGS, "max_tokens": 2},
        headers=both,
        timeout=60,
    )
    assert chat.status_code == 401
    assert chat.json()["error"]["code"] == "conflicting_api_keys"
    msg = httpx.post(
        server.url + "/v1/messages",
        json={"model": run["name"], "messages": MSGS, "max_tokens": 2},
        headers={**both, **ANTHROPIC},
        timeout=60,
    )
    assert msg.status_code == 401
    assert msg.json()["type"] == "error"
    assert msg.json()["error"]["type"] == "authentication_error"
    # the same key twice is one key
    same = {"Authorization": f"Bearer {run['api_key']}", "x-api-key": run["api_key"]}
    models = httpx.get(server.url + "/v1/models", headers=same, timeout=60)
    assert models.status_code == 200


def test_key_rotation_keeps_the_keys_limits(server) -> None:
    run = _limited_run(server, "rotate", rpm=2)
    old = key_id(server, run)
    with admin(server) as a:
        r = a.post(f"/admin/v1/runs/{run['run_id']}/keys/{old}/rotate")
        assert r.status_code == 201, r.text
        new_key, new_id = r.json()["api_key"], r.json()["id"]
    assert quota(server, run, new_id)["requests_per_min"] == 2
    body = {"model": run["name"], "messages": MSGS, "max_tokens": 2}
    answers = _eight(server, "/v1/chat/completions", body, {"x-api-key": new_key})
    codes = [a.status_code for a in answers]
    assert codes.count(200) <= 2 and codes.count(429) >= 6, codes
