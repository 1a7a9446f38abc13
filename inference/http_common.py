"""HTTP plumbing of the HTTP backends (`inference.http_backend`): client, SSE, error mapping.

Error tree, as the gateway sees it (`inference.backend`)::

    BackendError            connection refused/reset, timeout, 5xx, malformed answer -> 503
    └── BackendOverloaded   429, or a 503 whose body says the queue is full           -> 429
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from inference.backend import BackendError, BackendOverloaded

logger = logging.getLogger(__name__)

OVERLOAD_HINTS = ("queue is full", "too many requests", "overloaded", "server busy")


@dataclass(frozen=True)
class HttpBackendConfig:
    """How a backend talks to one inference server over HTTP."""

    base_url: str  # e.g. http://127.0.0.1:8001 (no /v1)
    model: str | None = None  # served model name; None: the first one /v1/models lists
    connect_timeout_s: float = 5.0  # a server that does not accept within this is down
    read_timeout_s: float = 600.0  # longest silence inside one generation (CPU decoding is slow)
    control_timeout_s: float = 300.0  # pause/reload/resume calls
    max_connections: int = 256  # pooled connections to this server
    pool_shards: int = 8  # connection pools they are split over (see ShardedTransport)
    drain_timeout_s: float = 300.0  # hot swap: wait this long for in-flight requests

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://: {self.base_url!r}")
        if min(self.connect_timeout_s, self.read_timeout_s, self.control_timeout_s) <= 0:
            raise ValueError("timeouts must be > 0")
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
    """A pooled async client for one server; the caller closes it. Tests inject `transport`."""
    return httpx.AsyncClient(
        base_url=cfg.base_url.rstrip("/"),
        timeout=httpx.Timeout(cfg.read_timeout_s, connect=cfg.connect_timeout_s),
        transport=transport or ShardedTransport(cfg.max_connections, cfg.pool_shards),
    )


@contextlib.contextmanager
def transport_errors(what: str) -> Iterator[None]:
    """Turn httpx's connection and timeout errors into `BackendError` naming `what`."""
    try:
        yield
    except httpx.TransportError as exc:
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


def json_body(resp: httpx.Response, what: str) -> Any:
    """The answer's JSON; a body that is not JSON is a `BackendError` naming `what`."""
    try:
        return resp.json()
    except ValueError as exc:
        raise BackendError(f"{what}: answer is not JSON: {resp.text[:200]}") from exc


async def iter_sse(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of a `text/event-stream` body, until `data: [DONE]` or its end.

    An event carrying an `error` object (vLLM and SGLang report mid-stream failures
    this way) raises `BackendError`.
    """
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments, `event:` lines
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            event = json.loads(data)
        except ValueError as exc:
            raise BackendError(f"malformed event in stream: {data[:200]}") from exc
        if isinstance(event, dict) and event.get("error"):
            err = event["error"]
            msg = err.get("message", err) if isinstance(err, dict) else err
            raise BackendError(f"server error mid-stream: {msg}")
        yield event
