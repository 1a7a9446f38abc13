"""Every request field that drives the gateway's CPU or memory has a cap (gateway/request_caps.py):
one past it is the API family's 400 naming the field, and a request AT it is not refused by
the cap (it is answered, or, where the tiny model's 1,024-token context cannot hold it, refused
for the context alone)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from gateway.request_caps import CAPS

if TYPE_CHECKING:
    from tests.conftest import GatewayServer

pytestmark = pytest.mark.integration

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def run(gateway_server: GatewayServer) -> dict:
    return gateway_server.create_run(name="caps")


@pytest.fixture(scope="module")
def http(gateway_server: GatewayServer, run: dict) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {run['api_key']}"}
    with httpx.Client(base_url=gateway_server.url, headers=headers, timeout=120) as c:
        yield c


def _tools(n: int, *, anthropic: bool = False) -> list[dict[str, Any]]:
    if anthropic:
        return [{"name": f"t{i}", "input_schema": {"type": "object"}} for i in range(n)]
    return [{"type": "function", "function": {"name": f"t{i}"}} for i in range(n)]


def _turns(n: int) -> list[dict[str, str]]:
    return [{"role": ("user", "assistant")[i % 2], "content": "x"} for i in range(n - 1)] + USER


def _parts(n: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "x"}] * n}]


def _bias(n: int) -> dict[str, float]:
    return {str(i): 1.0 for i in range(n)}


# (case, field the error names, the over-the-cap change, the at-the-cap change)
CHAT = [
    ("stop count", "stop", {"stop": ["a"] * (CAPS.stop_strings + 1)}, {"stop": ["a"] * 4}),
    (
        "stop length",
        "stop",
        {"stop": ["a" * (CAPS.stop_string_chars + 1)]},
        {"stop": ["a" * CAPS.stop_string_chars]},
    ),
    ("stop of 300,000 characters", "stop", {"stop": "a" * 300_000}, {"stop": "a"}),
    ("messages", "messages", {"messages": _turns(CAPS.messages + 1)}, {"messages": _turns(64)}),
    ("tools", "tools", {"tools": _tools(CAPS.tools + 1)}, {"tools": _tools(8)}),
    (
        "content parts",
        "messages.0.content",
        {"messages": _parts(CAPS.content_parts + 1)},
        {"messages": _parts(CAPS.content_parts)},
    ),
    (
        "logit_bias",
        "logit_bias",
        {"logit_bias": _bias(CAPS.logit_bias + 1)},
        {"logit_bias": _bias(CAPS.logit_bias)},
    ),
    ("n", "n", {"n": CAPS.n + 1}, {"n": CAPS.n}),
    ("max_tokens past int32", "max_tokens", {"max_tokens": 2**31}, {"max_tokens": 8}),
    ("max_tokens of 4,000 digits", "max_tokens", {"max_tokens": 10**4000}, {"max_tokens": 8}),
    # OpenAI names the messages when the prompt and max_tokens overflow the context.
    ("max_tokens past the context", "messages", {"max_tokens": 1024}, {"max_tokens": 900}),
]


def _chat(run: dict, change: dict) -> dict:
    return {"model": run["name"], "messages": USER, "max_tokens": 2} | change


def _refused_for_context_only(resp: httpx.Response) -> bool:
    return resp.status_code == 400 and "context" in str(resp.json())


@pytest.mark.parametrize(("param", "over", "at"), [c[1:] for c in CHAT], ids=[c[0] for c in CHAT])
def test_chat_caps(http: httpx.Client, run: dict, param: str, over: dict, at: dict) -> None:
    resp = http.post("/v1/chat/completions", json=_chat(run, over))
    assert resp.status_code == 400, resp.text[:300]
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    ok = http.post("/v1/chat/completions", json=_chat(run, at))
    assert ok.status_code == 200 or _refused_for_context_only(ok), ok.text[:300]


def test_messages_at_the_cap_render(http: httpx.Client, run: dict) -> None:
    """The message cap itself: 2,048 turns are counted (the context, not the cap, is the
    limit for sampling them on the tiny model)."""
    body = {"model": run["name"], "messages": _turns(CAPS.messages), "max_tokens": 2}
    ok = http.post("/v1/chat/completions", json=body)
    assert _refused_for_context_only(ok), ok.text[:300]
    body.pop("max_tokens")
    counted = http.post("/v1/messages/count_tokens", json=body)
    assert counted.status_code == 200 and counted.json()["input_tokens"] > CAPS.messages


ANTHROPIC = [
    ("stop count", {"stop_sequences": ["a"] * 5}, {"stop_sequences": ["a"] * 4}),
    (
        "stop length",
        {"stop_sequences": ["a" * (CAPS.stop_string_chars + 1)]},
        {"stop_sequences": ["a" * CAPS.stop_string_chars]},
    ),
    ("stop of 300,000 characters", {"stop_sequences": ["a" * 300_000]}, {}),
    ("messages", {"messages": _turns(CAPS.messages + 1)}, {"messages": _turns(64)}),
    (
        "tools",
        {"tools": _tools(CAPS.tools + 1, anthropic=True)},
        {"tools": _tools(8, anthropic=True)},
    ),
    (
        "content blocks",
        {"messages": _parts(CAPS.content_parts + 1)},
        {"messages": _parts(CAPS.content_parts)},
    ),
    (
        "system blocks",
        {"system": [{"type": "text", "text": "s"}] * (CAPS.content_parts + 1)},
        {"system": [{"type": "text", "text": "s"}] * CAPS.content_parts},
    ),
    ("max_tokens past int32", {"max_tokens": 2**31}, {"max_tokens": 8}),
    ("max_tokens past the context", {"max_tokens": 1024}, {"max_tokens": 900}),
    ("top_k past int32", {"top_k": 2**31}, {"top_k": 40}),
]


@pytest.mark.parametrize(("over", "at"), [c[1:] for c in ANTHROPIC], ids=[c[0] for c in ANTHROPIC])
def test_messages_caps(http: httpx.Client, run: dict, over: dict, at: dict) -> None:
    base = {"model": run["name"], "messages": USER, "max_tokens": 2}
    resp = http.post("/v1/messages", json=base | over)
    assert resp.status_code == 400, resp.text[:300]
    body = resp.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert set(body["error"]) == {"type", "message"}
    ok = http.post("/v1/messages", json=base | at)
    assert ok.status_code == 200 or _refused_for_context_only(ok), ok.text[:300]


OTHERS = [
    (
        "/v1/responses",
        "input",
        {"input": _turns(CAPS.messages + 1)},
        {"input": _turns(16)},
    ),
    ("/v1/responses", "tools", {"tools": [{"type": "function", "name": "f"}] * 129}, {}),
    ("/v1/responses", "max_output_tokens", {"max_output_tokens": 2**31}, {}),
    ("/v1/completions", "stop", {"stop": ["a" * (CAPS.stop_string_chars + 1)]}, {"stop": "ab"}),
    ("/v1/completions", "stop", {"stop": ["a"] * 5}, {"stop": ["a"] * 4}),
    ("/v1/completions", "logit_bias", {"logit_bias": _bias(301)}, {"logit_bias": _bias(300)}),
    ("/v1/completions", "max_tokens", {"max_tokens": 2**31}, {"max_tokens": 8}),
]


@pytest.mark.parametrize(("path", "param", "over", "at"), OTHERS)
def test_responses_and_completions_caps(
    http: httpx.Client, run: dict, path: str, param: str, over: dict, at: dict
) -> None:
    if path == "/v1/responses":
        base: dict[str, Any] = {"model": run["name"], "input": "hi", "max_output_tokens": 2}
    else:
        base = {"model": run["name"], "prompt": "hi", "max_tokens": 2}
    resp = http.post(path, json=base | over)
    assert resp.status_code == 400, resp.text[:300]
    assert resp.json()["error"]["param"] == param
    ok = http.post(path, json=base | at)
    assert ok.status_code == 200, ok.text[:300]


def test_the_caps_are_in_the_openapi_schema(http: httpx.Client) -> None:
    """Clients and fuzzers see the caps (maxItems) that the gateway enforces."""
    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["messages"]["maxItems"] == CAPS.messages
    assert {"type": "integer", "minimum": 1, "maximum": CAPS.n} in chat["n"]["anyOf"]
