"""Malformed bodies of every kind, on every agent endpoint, with a valid key: the API family's
4xx, never a 500, and the keep-alive connection they came on still serves the next request."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import pytest

from gateway.errors import is_anthropic_path

if TYPE_CHECKING:
    from tests.conftest import GatewayServer

pytestmark = pytest.mark.integration

DEEP = 100_000
DIGITS = b"9" * 100_000

# (kind, body): each is refused whatever the endpoint expects.
BODIES: list[tuple[str, bytes]] = [
    ("nested arrays", b"[" * DEEP + b"]" * DEEP),
    ("nested objects", b'{"a":' * DEEP + b"1" + b"}" * DEEP),
    ("nested in a field", b'{"model": "m", "messages": ' + b"[" * DEEP + b"]" * DEEP + b"}"),
    ("nested, unclosed", b"[" * DEEP),
    ("invalid utf-8", b'{"model": "\xff\xfe", "messages": []}'),
    ("invalid utf-8 in a key", b'{"mo\xc3del": "m"}'),
    ("lone surrogate", b'{"model": "\\ud800", "input": "\\udfff", "messages": []}'),
    ("wrong type, depth 1", b'{"model": ["m"], "messages": {"role": "user"}, "input": 3}'),
    ("wrong type, depth 2", b'{"model": "m", "messages": [7], "input": [7], "reward": "x"}'),
    (
        "wrong type, depth 3",
        b'{"model": "m", "messages": [{"role": "user", "content": [{"type": 1}]}],'
        b' "input": [{"role": "user", "content": 5}], "reward": [1]}',
    ),
    ("duplicate keys, last one bad", b'{"model": "m", "model": 7, "reward": 1, "reward": "x"}'),
    ("huge exponent", b'{"model": "m", "max_tokens": 1e999999, "reward": 1e999999}'),
    ("huge integer", b'{"model": "m", "max_tokens": ' + DIGITS + b', "reward": ' + DIGITS + b"}"),
    (
        "huge float",
        b'{"model": "m", "temperature": 1' + DIGITS + b'.5, "reward": 1' + DIGITS + b"}",
    ),
    ("NaN", b'{"model": "m", "temperature": NaN, "max_tokens": NaN, "reward": NaN}'),
    ("Infinity", b'{"model": "m", "temperature": Infinity, "reward": -Infinity}'),
    ("top-level array", b'[{"model": "m"}]'),
    ("top-level string", b'"model"'),
    ("top-level number", b"17"),
    ("top-level null", b"null"),
    ("truncated", b'{"model": "m", "messages": [{"role": "us'),
    ("trailing garbage", b'{"model": "m"} }'),
    ("empty", b""),
    ("BOM before an incomplete body", b'\xef\xbb\xbf{"model": "m"}'),
    ("BOM alone", b"\xef\xbb\xbf"),
    ("NUL bytes", b"\x00" * 64),
]

ENDPOINTS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/rewards",
    "/episodes/ep-bad/v1/chat/completions",
    "/episodes/ep-bad/v1/completions",
    "/episodes/ep-bad/v1/responses",
    "/episodes/ep-bad/v1/messages",
    "/episodes/ep-bad/v1/messages/count_tokens",
    "/episodes/ep-bad/v1/rewards",
]


@pytest.fixture(scope="module")
def run(gateway_server: GatewayServer) -> dict:
    return gateway_server.create_run(name="malformed")


@pytest.fixture
def conn(gateway_server: GatewayServer) -> Iterator[http.client.HTTPConnection]:
    parts = urlsplit(gateway_server.url)
    c = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    yield c
    c.close()


def _post(c: http.client.HTTPConnection, path: str, body: bytes, key: str):
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    c.request("POST", path, body=body, headers=headers)
    resp = c.getresponse()
    return resp, resp.read()


def _assert_family_shape(path: str, payload: bytes) -> None:
    body = json.loads(payload)
    if is_anthropic_path(path):
        assert body["type"] == "error", body
        assert set(body["error"]) == {"type", "message"}, body
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
    # A body that parses may still name no model of this key: a 404, also a client error.
    assert body["error"]["type"] in ("invalid_request_error", "not_found_error"), body


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize(("kind", "body"), BODIES, ids=[b[0] for b in BODIES])
def test_a_malformed_body_is_a_4xx_and_the_connection_lives_on(
    conn: http.client.HTTPConnection, run: dict, path: str, kind: str, body: bytes
) -> None:
    resp, payload = _post(conn, path, body, run["api_key"])
    assert 400 <= resp.status < 500, (resp.status, payload[:300])
    _assert_family_shape(path, payload)
    assert resp.getheader("connection", "").lower() != "close"
    sock = conn.sock
    assert sock is not None, "the gateway closed the connection"
    # The next request on the same connection: answered, on the same socket.
    conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {run['api_key']}"})
    nxt = conn.getresponse()
    nxt.read()
    assert nxt.status == 200 and conn.sock is sock
