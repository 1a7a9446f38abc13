"""HTTP plumbing of the HTTP backends (`inference.http_backend`): clients, SSE, error mapping.

Two clients per backend: an aiohttp session for the sampling calls (the hot
path: aiohttp's client costs a fraction of httpx's per request) and an httpx
client for everything else (control calls, health, tests' injected transports).

Error tree, as the gateway sees it (`inference.backend`)::

    BackendError            connection refused/reset, timeout, 5xx, malformed answer -> 503
    └── BackendOverloaded   429, or a 503 whose body says the queue is full           -> 429
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import AsyncIterable, AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
import orjson
import yarl

from core.config import ServerCredentials
from inference.backend import BackendError, BackendOverloaded
from inference.types import VersionStarts

logger = logging.getLogger(__name__)

OVERLOAD_HINTS = ("queue is full", "too many requests", "overloaded", "server busy")

# Idle pooled connections are dropped before the server drops them (uvicorn, under vLLM and
# SGLang, after 5 s), so a request seldom goes out on a connection the server is closing.
KEEPALIVE_S = 4.0
JSON_HEADERS = {"Content-Type": "application/json"}
# A stream's body has usually ended when `data: [DONE]` arrives; wait this long for its end
# so that the connection goes back to the pool instead of being closed.
STREAM_END_S = 1.0
# The connection broke before any answer arrived (a kept-alive connection the server closed as
# the request went out): nothing was answered, so the request is sent once more. A connector
# error (refused, unreachable) is not one of these: that server is down.
UNANSWERED = (
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
    aiohttp.ClientConnectionResetError,
)


@dataclass(frozen=True)
class HttpBackendConfig:
    """How a backend talks to one inference server over HTTP."""

    base_url: str  # e.g. http://127.0.0.1:8001 (no /v1)
    credentials: ServerCredentials = field(default_factory=ServerCredentials)
    model: str | None = None  # served model name; None: the first one /v1/models lists
    connect_timeout_s: float = 5.0  # a server that does not accept within this is down
    read_timeout_s: float = 600.0  # longest silence inside one generation (CPU decoding is slow)
    control_timeout_s: float = 300.0  # pause/reload/resume calls
    max_connections: int = 256  # pooled connections to this server
    pool_shards: int = 8  # connection pools they are split over (see ShardedTransport)
    drain_timeout_s: float = 300.0  # hot swap: wait this long for in-flight requests
    # Keep-mode swap on a server that labels no tokens: once it is paused, the tokens sampled
    # before the pause count as arrived when no stream of the swapped lane has received one
    # for this long (it runs alongside the reload, so it seldom lengthens the swap).
    pause_settle_s: float = 0.2

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://: {self.base_url!r}")
        if min(self.connect_timeout_s, self.read_timeout_s, self.control_timeout_s) <= 0:
            raise ValueError("timeouts must be > 0")
        if self.pause_settle_s <= 0:
            raise ValueError("pause_settle_s must be > 0")
        if self.max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        if not 1 <= self.pool_shards <= self.max_connections:
            raise ValueError("pool_shards must be between 1 and max_connections")


class ShardedTransport(httpx.AsyncBaseTransport):
    """Requests spread round-robin over several connection pools to the same server.

    httpcore's pool walks every connection it holds (and polls each idle
    socket) whenever a request starts or ends, so its cost per request grows
    with the pool. With many concurrent agents that walk took about a sixth
    of the gateway's CPU (py-spy, `rlgate bench gateway`). `shards` pools of
    `max_connections / shards` connections each make every walk that much
    shorter; the total connection limit stays `max_connections`.

    A request whose connection breaks before any response arrives (the server
    closed a kept-alive connection just as the request went out) is sent once
    more, through the next pool. Nothing of it was answered, and the gateway
    stores only the answer it gets, so a resend cannot store anything twice.
    A refused connection is not resent: that server is down, and the replica
    set decides what happens next.
    """

    def __init__(self, max_connections: int, shards: int) -> None:
        per = max(1, -(-max_connections // shards))
        limits = httpx.Limits(max_connections=per, max_keepalive_connections=per)
        self._pools = [httpx.AsyncHTTPTransport(limits=limits) for _ in range(shards)]
        self._turn = itertools.cycle(self._pools)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await next(self._turn).handle_async_request(request)
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            logger.info("resending %s %s: %r", request.method, request.url.path, exc)
            return await next(self._turn).handle_async_request(request)

    async def aclose(self) -> None:
        for pool in self._pools:
            await pool.aclose()


def make_client(
    cfg: HttpBackendConfig, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    """A pooled async client for one server (control calls; everything when a test injects
    `transport`); the caller closes it."""
    return httpx.AsyncClient(
        base_url=cfg.base_url.rstrip("/"),
        headers=cfg.credentials.headers(),
        timeout=httpx.Timeout(cfg.read_timeout_s, connect=cfg.connect_timeout_s),
        transport=transport or ShardedTransport(cfg.max_connections, cfg.pool_shards),
    )


def make_session(cfg: HttpBackendConfig) -> aiohttp.ClientSession:
    """The sampling calls' pooled session for one server; make it inside the running loop.

    Timeouts as httpx's in `make_client`: `connect_timeout_s` to open a connection,
    `read_timeout_s` of silence inside an answer, and as long to wait for a free
    connection when all `max_connections` are busy (aiohttp's `connect` covers that
    wait; httpx calls it the pool timeout). No total: a generation may run long.
    """
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=cfg.max_connections, keepalive_timeout=KEEPALIVE_S),
        timeout=aiohttp.ClientTimeout(
            total=None,
            connect=cfg.read_timeout_s,
            sock_connect=cfg.connect_timeout_s,
            sock_read=cfg.read_timeout_s,
        ),
        cookie_jar=aiohttp.DummyCookieJar(),  # inference servers set none; skip the parsing
        headers=cfg.credentials.headers(),
    )


async def post_json(
    session: aiohttp.ClientSession, url: yarl.URL, body: dict[str, Any]
) -> aiohttp.ClientResponse:
    """POST `body` as JSON; the response, its headers read. The caller releases it.

    Resent once when the connection broke before any answer (`UNANSWERED`), like
    `ShardedTransport` does for httpx; a refused connection is not resent.
    """
    data = orjson.dumps(body)
    try:
        return await session.post(url, data=data, headers=JSON_HEADERS)
    except aiohttp.ClientConnectorError:
        raise
    except UNANSWERED as exc:
        logger.info("resending POST %s: %r", url.path, exc)
        return await session.post(url, data=data, headers=JSON_HEADERS)


async def end_stream(resp: aiohttp.ClientResponse) -> None:
    """Let go of a stream's response: its connection back to the pool if the body ended
    (soon after `data: [DONE]`), else closed, which makes the server abort the request."""
    try:
        if not resp.content.at_eof():
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with asyncio.timeout(STREAM_END_S):
                    while await resp.content.readany():
                        pass
    finally:
        if resp.content.at_eof():
            resp.release()
        else:
            resp.close()


@contextlib.contextmanager
def transport_errors(what: str) -> Iterator[None]:
    """Turn httpx's and aiohttp's connection and timeout errors into `BackendError` naming
    `what`."""
    try:
        yield
    except (httpx.TransportError, aiohttp.ClientError, TimeoutError) as exc:
        raise BackendError(f"{what}: {type(exc).__name__}: {exc}") from exc


def check_status(status: int, body: str, what: str) -> None:
    """Raise the `BackendError` that an HTTP status of the server means (nothing for 2xx)."""
    if status < 400:
        return
    detail = body[:500]
    if status == 429 or (status == 503 and any(h in body.lower() for h in OVERLOAD_HINTS)):
        raise BackendOverloaded(f"{what}: HTTP {status}: {detail}")
    raise BackendError(f"{what}: HTTP {status}: {detail}")


async def check_response(resp: httpx.Response, what: str) -> None:
    """`check_status` for a response whose body may not have been read yet (streams)."""
    if resp.status_code >= 400:
        body = (await resp.aread()).decode(errors="replace")
        check_status(resp.status_code, body, what)


def loads(raw: bytes) -> Any:
    """JSON from bytes: orjson, falling back to `json` for what only it reads (NaN, Infinity).

    Raises ValueError if it is not JSON.
    """
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def json_answer(raw: bytes, what: str) -> Any:
    """The answer's JSON; a body that is not JSON is a `BackendError` naming `what`."""
    try:
        return loads(raw)
    except ValueError as exc:
        text = raw[:200].decode(errors="replace")
        raise BackendError(f"{what}: answer is not JSON: {text}") from exc


def json_body(resp: httpx.Response, what: str) -> Any:
    """`json_answer` of an httpx response."""
    return json_answer(resp.content, what)


async def iter_sse(chunks: AsyncIterable[bytes]) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of a `text/event-stream` body, until `data: [DONE]` or its end.

    `chunks` is the body as it arrives, cut anywhere (httpx's `aiter_bytes`, aiohttp's
    `content.iter_any`): lines are split here, with no limit on their length. An event
    carrying an `error` object (vLLM and SGLang report mid-stream failures this way)
    raises `BackendError`.
    """
    rest = b""
    async for chunk in chunks:
        *lines, rest = (rest + chunk).split(b"\n")
        for line in lines:
            if (event := _sse_event(line)) is _DONE:
                return
            if event is not None:
                yield event
    if (event := _sse_event(rest)) is not None and event is not _DONE:
        yield event  # a last line without its newline


_DONE: Any = object()  # `data: [DONE]`


def _sse_event(line: bytes) -> Any:
    """The JSON event of one SSE line; None for other lines, `_DONE` at the end."""
    if not line.startswith(b"data:"):
        return None  # blank separators, comments, `event:` lines
    data = line[5:].strip()
    if data == b"[DONE]":
        return _DONE
    try:
        event = loads(data)
    except ValueError as exc:
        text = data[:200].decode(errors="replace")
        raise BackendError(f"malformed event in stream: {text}") from exc
    if isinstance(event, dict) and event.get("error"):
        err = event["error"]
        msg = err.get("message", err) if isinstance(err, dict) else err
        raise BackendError(f"server error mid-stream: {msg}")
    return event


def version_starts_of(spans: Any, n_tokens: int) -> VersionStarts | None:
    """`VersionStarts` from a server's per-token weight labels, vLLM's `weight_versions`
    (`[{"version": "<label>", "start": i, "end": j}, ...]`, labels that rlgate set to the
    version number).

    Leading spans whose label is no version number (vLLM's first label, "default", before
    rlgate labelled the server) are left out: the starts then begin after token 0, and
    `HttpBackend` gives those tokens the version the request was admitted on. None when
    there is no labelled span, a later label is no version number, or the versions go back.
    """
    if not isinstance(spans, list) or not spans:
        return None
    starts: list[tuple[int, int]] = []
    try:
        for span in sorted(spans, key=lambda s: int(s["start"])):
            if int(span["end"]) <= int(span["start"]):
                continue
            label = str(span["version"])
            if not label.lstrip("-").isdigit():
                if starts:
                    return None
                continue
            version = int(label)
            if starts and version < starts[-1][1]:
                return None
            if not starts or version > starts[-1][1]:
                starts.append((int(span["start"]), version))
    except (KeyError, TypeError, ValueError):
        return None
    if not starts or starts[-1][0] >= max(n_tokens, 1):
        return None
    return tuple(starts)
