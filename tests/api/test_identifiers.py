"""Episode and group ids in every form they arrive in (issue #22, item 4).

An emoji episode id in the path used to answer 500 (the id went back out in a
Latin-1 response header). The rule now (gateway/identifiers.py): 1 to 100
printable characters, no '/', no leading '~', the same for the path, the
headers and `metadata`; anything else is a 400 naming the field; an allowed id
is echoed percent-encoded, so any id survives the header.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote

import httpx
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gateway.identifiers import MAX_ID_LENGTH, id_problem

if TYPE_CHECKING:
    from tests.conftest import GatewayServer

pytestmark = pytest.mark.integration

USER = [{"role": "user", "content": "hi"}]
FUZZ = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
# Arbitrary Unicode ids, weighted towards the interesting edges: emoji, CJK, controls,
# separators, '/', '%', '~', and lengths around the limit.
edgy = st.sampled_from(["😀", "é", "漢", "\x00", "\n", "\u2028", "\u200b", " ", "/", "%", "~", "a"])
ids = st.text(min_size=0, max_size=MAX_ID_LENGTH + 5) | st.lists(edgy, max_size=8).map("".join)


@pytest.fixture(scope="module")
def run(gateway_server: GatewayServer) -> dict:
    return gateway_server.create_run(name="ids", config={"max_pending_episodes": 10**6})


@pytest.fixture(scope="module")
def http(gateway_server: GatewayServer, run: dict) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {run['api_key']}"}
    with httpx.Client(base_url=gateway_server.url, headers=headers, timeout=60) as c:
        yield c


def chat(http: httpx.Client, path: str = "/v1", **kw) -> httpx.Response:
    body = {"model": "ids", "messages": USER, "max_tokens": 2, **kw.pop("body", {})}
    return http.post(f"{path}/chat/completions", json=body, **kw)


def assert_400(resp: httpx.Response, param: str) -> None:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


def echoed(resp: httpx.Response, header: str = "x-rlgate-episode-id") -> str:
    value = resp.headers[header]
    assert value.isascii()
    return unquote(value)


@pytest.mark.parametrize("episode", ["😀", "café", "漢字 with space", "a%2Fb", "x" * MAX_ID_LENGTH])
def test_unicode_ids_in_the_path_are_stored_and_echoed(
    http: httpx.Client, gateway_server: GatewayServer, episode: str
) -> None:
    resp = chat(http, f"/episodes/{quote(episode, safe='')}/v1")
    assert resp.status_code == 200, resp.text
    assert resp.json()["episode_id"] == episode
    assert echoed(resp) == episode
    stored = gateway_server.completion(resp.json()["id"])
    assert stored is not None and stored["episode_id"] == episode


def test_streamed_answers_echo_unicode_ids(http: httpx.Client) -> None:
    with http.stream(
        "POST",
        "/episodes/%F0%9F%98%80-stream/v1/chat/completions",
        json={"model": "ids", "messages": USER, "max_tokens": 2, "stream": True},
    ) as resp:
        assert resp.status_code == 200
        assert echoed(resp) == "😀-stream"
        assert "[DONE]" in resp.read().decode()


def test_header_ids_are_utf8(http: httpx.Client) -> None:
    resp = chat(http, headers={"X-Episode-Id": "😀-hdr".encode(), "X-Group-Id": "grüppe".encode()})
    assert resp.status_code == 200, resp.text
    assert resp.json()["episode_id"] == "😀-hdr"
    assert echoed(resp) == "😀-hdr"
    assert_400(chat(http, headers={"X-Episode-Id": b"\xff\xfe"}), "episode_id")


def test_metadata_ids_follow_the_same_rule(http: httpx.Client) -> None:
    ok = chat(http, body={"metadata": {"episode_id": "😀-meta", "group_id": "g 1"}})
    assert ok.status_code == 200 and echoed(ok) == "😀-meta"
    assert_400(chat(http, body={"metadata": {"episode_id": "a/b"}}), "episode_id")
    assert_400(chat(http, body={"metadata": {"group_id": "x" * 101}}), "group_id")
    assert_400(chat(http, body={"metadata": {"episode_id": "tab\there"}}), "episode_id")


@pytest.mark.parametrize(
    ("path", "param"),
    [
        ("/episodes/%00/v1", "episode_id"),
        ("/episodes/%E2%80%A8/v1", "episode_id"),  # line separator
        ("/episodes/~mine/v1", "episode_id"),
        (f"/episodes/{'x' * (MAX_ID_LENGTH + 1)}/v1", "episode_id"),
        ("/groups/%0A/episodes/e1/v1", "group_id"),
    ],
)
def test_ids_outside_the_rule_are_400_naming_the_field(
    http: httpx.Client, gateway_server: GatewayServer, path: str, param: str
) -> None:
    before = gateway_server.count("completions")
    assert_400(chat(http, path), param)
    assert gateway_server.count("completions") == before


@FUZZ
@given(episode=ids, in_path=st.booleans())
def test_any_id_is_a_200_or_a_400_never_a_500(
    http: httpx.Client, gateway_server: GatewayServer, episode: str, in_path: bool
) -> None:
    if in_path:
        # An empty segment, or one with '/' once the server has decoded the path, is
        # another route (404), not an id; clients normalise '.' and '..' away.
        assume(episode and "/" not in episode and episode not in (".", ".."))
        resp = chat(http, f"/episodes/{quote(episode, safe='')}/v1")
    else:
        # HTTP itself forbids control characters in a header and trims its spaces.
        assume(episode == episode.strip(" \t"))
        assume(not any(ord(ch) < 32 or ord(ch) == 127 for ch in episode))
        resp = chat(http, headers={"X-Episode-Id": episode.encode("utf-8", "surrogatepass")})
    assert resp.status_code < 500, resp.text
    if not episode:
        assert resp.status_code == 200  # an empty header names no episode: a new one
    elif id_problem(episode) is None:
        assert resp.status_code == 200, resp.text
        assert echoed(resp) == episode == resp.json()["episode_id"]
    else:
        assert_400(resp, "episode_id")
