"""`AgentRoute` answers as FastAPI's own route does, for every input shape an agent can send.

Two apps with the same endpoints and the gateway's error funnel, one on FastAPI's
`APIRoute`, one on `AgentRoute`: each request goes to both, and status, body
and the headers an endpoint sets must match.
"""

from __future__ import annotations

from typing import Annotated, Any

import pytest
from fastapi import APIRouter, Depends, FastAPI, Query, Request, Response
from fastapi.responses import PlainTextResponse
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from pydantic import BaseModel, ConfigDict, Field

from gateway.agent.route import AgentRoute
from gateway.errors import AuthenticationFailed, install_error_handlers


class Ask(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    n: int = Field(default=1, ge=1)
    reply: str = "model"  # "model", "dict", "bad", "response", "status"
    items: list[dict[str, int]] | None = None


class Answer(BaseModel):
    id: str
    text: str
    note: str | None = None


async def caller(request: Request) -> str:
    key = request.headers.get("authorization", "")
    if key != "Bearer good":
        raise AuthenticationFailed("invalid API key", code="invalid_api_key")
    return key


async def episode(request: Request) -> str | None:
    return request.path_params.get("episode_id")


Caller = Annotated[str, Depends(caller)]
Episode = Annotated[str | None, Depends(episode)]


async def nested(who: Caller) -> str:
    return who


def make_app(route_class: type[APIRoute]) -> FastAPI:
    router = APIRouter(route_class=route_class)

    @router.post("/v1/ask", response_model=Answer)
    async def ask(body: Ask, who: Caller, ep: Episode, request: Request, response: Response) -> Any:
        response.headers["X-Episode"] = ep or "none"
        if body.reply == "dict":
            return {"id": "d", "text": body.model, "extra": "dropped"}
        if body.reply == "bad":
            return {"id": "d"}  # not an Answer: FastAPI refuses it as a server error
        if body.reply == "response":
            return PlainTextResponse("raw", headers={"X-Own": "1"})
        if body.reply == "status":
            response.status_code = 202
        return Answer(id=request.url.path, text=f"{body.model}x{body.n}", note=who)

    @router.get("/v1/things/{thing_id}")
    async def thing(thing_id: str, who: Caller) -> dict[str, str]:
        return {"thing": thing_id}

    app = FastAPI()
    install_error_handlers(app)
    for prefix in ("", "/episodes/{episode_id}"):
        app.include_router(router, prefix=prefix)
    return app


@pytest.fixture(scope="module")
def clients() -> tuple[TestClient, TestClient]:
    fastapi_app, agent_app = make_app(APIRoute), make_app(AgentRoute)
    with (
        TestClient(fastapi_app, raise_server_exceptions=False) as a,
        TestClient(agent_app, raise_server_exceptions=False) as b,
    ):
        yield a, b


GOOD = {"Authorization": "Bearer good", "Content-Type": "application/json"}
BAD = {"Authorization": "Bearer nope", "Content-Type": "application/json"}

CASES = [
    ("ok", "/v1/ask", GOOD, b'{"model": "m", "n": 3}'),
    ("under an episode", "/episodes/ep-1/v1/ask", GOOD, b'{"model": "m"}'),
    ("unknown fields kept", "/v1/ask", GOOD, b'{"model": "m", "future": [1]}'),
    ("dict answer", "/v1/ask", GOOD, b'{"model": "m", "reply": "dict"}'),
    ("answer not the model", "/v1/ask", GOOD, b'{"model": "m", "reply": "bad"}'),
    ("endpoint's own response", "/v1/ask", GOOD, b'{"model": "m", "reply": "response"}'),
    ("status set", "/v1/ask", GOOD, b'{"model": "m", "reply": "status"}'),
    ("not json", "/v1/ask", GOOD, b'{"model": '),
    ("not json, bad key", "/v1/ask", BAD, b"{nope"),
    ("bad key", "/v1/ask", BAD, b'{"model": "m"}'),
    ("invalid body, bad key", "/v1/ask", BAD, b'{"n": 0}'),
    ("missing field", "/v1/ask", GOOD, b'{"n": 2}'),
    ("out of range", "/v1/ask", GOOD, b'{"model": "m", "n": 0}'),
    ("wrong type", "/v1/ask", GOOD, b'{"model": ["m"]}'),
    ("array body", "/v1/ask", GOOD, b'[{"model": "m"}]'),
    ("scalar body", "/v1/ask", GOOD, b"17"),
    ("empty body", "/v1/ask", GOOD, b""),
    ("no content type", "/v1/ask", {"Authorization": "Bearer good"}, b'{"model": "m"}'),
    ("text content type", "/v1/ask", GOOD | {"Content-Type": "text/plain"}, b'{"model": "m"}'),
    ("+json type", "/v1/ask", GOOD | {"Content-Type": "application/x+json"}, b'{"model": "m"}'),
    ("charset", "/v1/ask", GOOD | {"Content-Type": "application/json; charset=utf-8"}, b"{}"),
    ("utf-8 text", "/v1/ask", GOOD, '{"model": "m\u00e9\u4e2d"}'.encode()),
    ("nan", "/v1/ask", GOOD, b'{"model": "m", "n": NaN}'),
    # Malformed bodies of every kind (see tests/security/test_malformed_bodies.py for the
    # gateway's endpoints): FastAPI answers each with a 4xx, never a 500.
    ("deeply nested array", "/v1/ask", GOOD, b"[" * 100_000 + b"]" * 100_000),
    ("deeply nested object", "/v1/ask", GOOD, b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
    (
        "deeply nested field",
        "/v1/ask",
        GOOD,
        b'{"model": "m", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    ),
    ("nested unclosed", "/v1/ask", GOOD, b"[" * 100_000),
    ("invalid utf-8", "/v1/ask", GOOD, b'{"model": "m\xff\xfe"}'),
    ("invalid utf-8 in a key", "/v1/ask", GOOD, b'{"mod\xc3el": "m"}'),
    ("wrong type, depth 1", "/v1/ask", GOOD, b'{"model": {"a": [1]}}'),
    ("wrong type, depth 2", "/v1/ask", GOOD, b'{"model": "m", "items": [{"k": "v"}]}'),
    ("wrong type, depth 3", "/v1/ask", GOOD, b'{"model": "m", "items": [{"k": [1]}], "n": "x"}'),
    ("duplicate keys", "/v1/ask", GOOD, b'{"model": "a", "model": "b", "n": 1, "n": 2}'),
    ("duplicate keys, last bad", "/v1/ask", GOOD, b'{"model": "a", "n": 1, "n": 0}'),
    ("huge exponent", "/v1/ask", GOOD, b'{"model": "m", "n": 1e999999}'),
    ("huge integer", "/v1/ask", GOOD, b'{"model": "m", "n": ' + b"9" * 100_000 + b"}"),
    ("huge integer elsewhere", "/v1/ask", GOOD, b'{"model": "m", "x": ' + b"9" * 100_000 + b"}"),
    ("huge negative integer", "/v1/ask", GOOD, b'{"model": "m", "n": -' + b"9" * 5_000 + b"}"),
    ("infinity", "/v1/ask", GOOD, b'{"model": "m", "n": Infinity}'),
    ("-infinity", "/v1/ask", GOOD, b'{"model": "m", "n": -Infinity}'),
    ("nan elsewhere", "/v1/ask", GOOD, b'{"model": "m", "x": NaN}'),
    ("top-level string", "/v1/ask", GOOD, b'"model"'),
    ("top-level null", "/v1/ask", GOOD, b"null"),
    ("truncated", "/v1/ask", GOOD, b'{"model": "m", "n": 1'),
    ("truncated string", "/v1/ask", GOOD, b'{"model": "m'),
    ("trailing garbage", "/v1/ask", GOOD, b'{"model": "m"} x'),
    ("two documents", "/v1/ask", GOOD, b'{"model": "m"}{"model": "m"}'),
    ("utf-8 bom", "/v1/ask", GOOD, b'\xef\xbb\xbf{"model": "m"}'),
    ("utf-16 body", "/v1/ask", GOOD, '{"model": "m"}'.encode("utf-16")),
    ("nul byte", "/v1/ask", GOOD, b'{"model": "m\x00"}'),
    ("deeply nested, bad key", "/v1/ask", BAD, b"[" * 100_000 + b"]" * 100_000),
    ("invalid utf-8, bad key", "/v1/ask", BAD, b'{"model": "\xff"}'),
]


@pytest.mark.parametrize(
    ("path", "headers", "body"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_same_answer_as_fastapi(clients, path: str, headers: dict, body: bytes) -> None:
    expected, got = (c.post(path, content=body, headers=headers) for c in clients)
    assert got.status_code == expected.status_code
    assert got.content == expected.content
    for name in ("content-type", "x-episode", "x-own"):
        assert got.headers.get(name) == expected.headers.get(name)


def test_a_lone_surrogate_is_a_400_where_fastapi_answered_500(clients) -> None:
    """FastAPI's parser lets `"\\ud800"` through and its answer then fails to encode."""
    body = b'{"model": "\\ud800"}'
    expected, got = (c.post("/v1/ask", content=body, headers=GOOD) for c in clients)
    assert expected.status_code == 500
    assert got.status_code == 400
    assert got.json()["error"]["code"] == "invalid_json"


@pytest.mark.parametrize(
    ("path", "headers"),
    [("/v1/things/t-1", GOOD), ("/episodes/e/v1/things/x%20y", GOOD), ("/v1/things/t", BAD)],
)
def test_path_parameters_as_fastapi(clients, path: str, headers: dict) -> None:
    expected, got = (c.get(path, headers=headers) for c in clients)
    assert (got.status_code, got.content) == (expected.status_code, expected.content)


def test_a_route_it_cannot_serve_is_refused_when_declared() -> None:
    router = APIRouter(route_class=AgentRoute)
    with pytest.raises(TypeError, match="query params are not handled"):

        @router.get("/v1/search")
        async def search(q: Annotated[str, Query()]) -> dict[str, str]:
            return {"q": q}

    with pytest.raises(TypeError, match="takes more than the request"):

        @router.post("/v1/nested")
        async def uses_nested(body: Ask, who: Annotated[str, Depends(nested)]) -> dict:
            return {}

    with pytest.raises(TypeError, match="not one pydantic model"):

        @router.post("/v1/many")
        async def many(body: Ask | list[Ask]) -> dict:
            return {}


def test_a_router_dependency_runs_for_its_check() -> None:
    router = APIRouter(route_class=AgentRoute, dependencies=[Depends(caller)])

    @router.post("/v1/checked")
    async def checked(body: Ask) -> dict[str, str]:
        return {"model": body.model}

    app = FastAPI()
    install_error_handlers(app)
    app.include_router(router)
    with TestClient(app) as client:
        good = client.post("/v1/checked", json={"model": "m"}, headers=GOOD)
        bad = client.post("/v1/checked", json={"model": "m"}, headers=BAD)
    assert (good.status_code, good.json()) == (200, {"model": "m"})
    assert bad.status_code == 401


def test_the_gateway_serves_its_sampling_routes_through_it() -> None:
    from gateway.routes import chat, completions, messages, responses

    for module in (chat, completions, messages, responses):
        routes = [r for r in module.router.routes if isinstance(r, APIRoute)]
        assert routes and all(isinstance(r, AgentRoute) for r in routes), module.__name__


@pytest.mark.parametrize("route_class", [APIRoute, AgentRoute])
async def test_a_client_gone_mid_body_is_a_400_not_a_500(route_class) -> None:
    """FastAPI answers a body it could not read with 400; `AgentRoute` too (a 500 would log
    a traceback and count as a server error for every client that hangs up)."""
    app = make_app(route_class)
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/ask",
        "raw_path": b"/v1/ask",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"authorization", b"Bearer good")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    await app(scope, receive, send)
    assert sent[0]["status"] == 400
