"""The shared body of every HTTP inference backend: pool, admission gate, drain, swap, streams.

A server-specific backend (`inference.vllm_http`, `inference.sglang_http`)
subclasses `HttpBackend` and says only how its server differs: the request
it sends for one generation (`_complete`, `_stream_tokens`), how it reads the
answer, and the calls that pause, reload and resume it. Everything that
decides *when* things happen lives here, so every HTTP backend keeps the
same ordering contract (below).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any, ClassVar, Self, TypeVar

import httpx

from inference.backend import BackendError
from inference.http_common import (
    HttpBackendConfig,
    check_response,
    check_status,
    iter_sse,
    json_body,
    make_client,
    transport_errors,
)
from inference.types import FinishReason, GenerateRequest, GenerateResult

logger = logging.getLogger(__name__)

T = TypeVar("T")

Tokens = list[tuple[int, float]]  # (token id, logprob) pairs, in sampling order


class HttpBackend(abc.ABC):
    """A `Backend` over one inference server's HTTP API.

    Hot swap, the ordering contract. `load_weights`:

    1. closes this backend's admission gate: new requests wait (nothing fails);
    2. drains: waits until every request it admitted has finished, up to
       `config.drain_timeout_s`;
    3. pauses the server, reloads the weights in place, and (even if the
       reload failed) resumes it: `_pause`, `_reload`, `_resume`;
    4. bumps `version` (only if the reload succeeded) and opens the gate.

    A request reads `version` when it is admitted, and no request is in
    flight while the weights change, so a completion never mixes versions:
    the version it reports sampled all of its tokens.

    Drain timeout: the stragglers are aborted, then the swap goes ahead. A
    request still running after `drain_timeout_s` is cancelled on our side
    (closing its connection, which makes the server abort it) and fails with
    `BackendError`; the tokens it had sampled came from the old weights and
    are not stored as a completion (a stream that had delivered tokens ends
    with the error, which the gateway answers like any backend failure, and
    a replica set retries a non-streaming one elsewhere). The alternative,
    refusing the swap and trying again later, would close the gate for
    another `drain_timeout_s` on every attempt while one stuck request holds
    the new version back indefinitely; `ReplicaSet` and `WeightSync` both
    expect a load that comes after a bounded wait.
    """

    name: ClassVar[str] = "HTTP server"  # the server's name in errors and logs, e.g. "vLLM"

    def __init__(
        self,
        config: HttpBackendConfig,
        version: int = 0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.config = config
        self._client = make_client(config, transport)
        self._version = version
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._gate = asyncio.Event()  # cleared while a swap is under way
        self._gate.set()
        self._swap_lock = asyncio.Lock()
        self._running: set[asyncio.Future[Any]] = set()  # admitted requests' calls
        self._aborted: set[asyncio.Future[Any]] = set()  # those cut off by a drain timeout

    @classmethod
    def for_url(cls, url: str, version: int = 0) -> Self:
        """The backend of the server at `url` with default settings, serving `version`."""
        return cls(HttpBackendConfig(base_url=url), version=version)

    @property
    def version(self) -> int:
        return self._version

    @property
    def url(self) -> str:
        return self.config.base_url

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}, version={self._version})"

    # --- what a server does differently (subclasses) -------------------------------

    @abc.abstractmethod
    async def _complete(self, request: GenerateRequest) -> tuple[Tokens, FinishReason]:
        """One non-streaming generation: its tokens and finish reason."""

    @abc.abstractmethod
    def _stream_tokens(
        self, request: GenerateRequest
    ) -> AsyncIterator[tuple[Tokens, FinishReason | None]]:
        """One streaming generation: per event, the NEW tokens and the finish reason if any."""

    async def _check_checkpoint(self, checkpoint_dir: Path, version: int) -> Path:
        """Refuse a checkpoint the server cannot load, before anything is paused."""
        return checkpoint_dir

    @abc.abstractmethod
    async def _pause(self) -> None:
        """Stop the server generating (after the drain; other clients' requests included)."""

    @abc.abstractmethod
    async def _reload(self, checkpoint_dir: Path, version: int) -> None:
        """Load `checkpoint_dir` into the paused server, in place."""

    @abc.abstractmethod
    async def _resume(self) -> None:
        """Let the server generate again (also after a failed reload)."""

    # --- the Backend interface --------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if not request.prompt_token_ids:
            raise BackendError("empty prompt")
        async with self.admitted() as version:
            tokens, finish = await self._abortable(self._complete(request))
        return GenerateResult([t for t, _ in tokens], [lp for _, lp in tokens], finish, version)

    def start_stream(self, request: GenerateRequest) -> HttpStream:
        if not request.prompt_token_ids:
            raise BackendError("empty prompt")
        return HttpStream(self, request)

    async def load_weights(self, checkpoint_dir: Path, version: int) -> None:
        """Swap in place, in the order of the class docstring."""
        checkpoint_dir = await self._check_checkpoint(Path(checkpoint_dir), version)
        async with self._swap_lock:
            self._gate.clear()
            try:
                await self._drain(version)
                await self._pause()
                try:
                    await self._reload(checkpoint_dir, version)
                    self._version = version
                finally:
                    await self._resume()
            finally:
                self._gate.set()
        logger.info("%s at %s serves version %d (%s)", self.name, self.url, version, checkpoint_dir)

    async def health(self) -> bool:
        try:
            resp = await self._client.get("/health", timeout=self.config.connect_timeout_s)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def close(self) -> None:
        await self._client.aclose()

    # --- admission and drain ------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def admitted(self) -> AsyncIterator[int]:
        """Hold a place among the in-flight requests; yields the version that will serve it."""
        await self._gate.wait()
        self._inflight += 1
        self._idle.clear()
        try:
            yield self._version
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    async def _abortable(self, call: Coroutine[Any, Any, T]) -> T:
        """Run an admitted request's call so that a drain timeout can abort it."""
        task = asyncio.ensure_future(call)
        self._running.add(task)
        try:
            return await task
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if task not in self._aborted or (me is not None and me.cancelling()):
                raise  # our caller was cancelled (a stream's `cancel`, a disconnect)
            raise BackendError(
                f"{self.name} at {self.url}: aborted after the drain timeout of a weight swap"
            ) from None
        finally:
            self._running.discard(task)
            self._aborted.discard(task)

    async def _drain(self, version: int) -> None:
        """Until no admitted request is in flight; at the timeout, abort the stragglers."""
        try:
            await asyncio.wait_for(self._idle.wait(), self.config.drain_timeout_s)
            return
        except TimeoutError:
            pass
        stragglers = list(self._running)
        logger.warning(
            "%s at %s: %d requests still running after %.0f s; aborting them to load v%d",
            self.name,
            self.url,
            len(stragglers),
            self.config.drain_timeout_s,
            version,
        )
        self._aborted.update(stragglers)
        for task in stragglers:
            task.cancel()
        await self._idle.wait()  # they unwind at once: their calls were cancelled

    # --- HTTP helpers for subclasses ----------------------------------------------------

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        """POST `body` to `path`; the answer's JSON (errors mapped as in `http_common`)."""
        with transport_errors(f"{self.name} at {self.url}"):
            resp = await self._client.post(path, json=body)
        check_status(resp.status_code, resp.text, f"{self.name} POST {path}")
        return json_body(resp, f"{self.name} POST {path}")

    async def _events(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """POST `body` to `path` and yield the JSON events of its server-sent event stream."""
        with transport_errors(f"{self.name} at {self.url}"):
            async with self._client.stream("POST", path, json=body) as resp:
                await check_response(resp, f"{self.name} POST {path} (stream)")
                async for event in iter_sse(resp):
                    yield event

    async def _control(self, path: str, **kwargs: Any) -> httpx.Response:
        """A pause/reload/resume call (`kwargs` go to httpx: json, params)."""
        with transport_errors(f"{self.name} at {self.url}"):
            resp = await self._client.post(path, timeout=self.config.control_timeout_s, **kwargs)
        check_status(resp.status_code, resp.text, f"{self.name} POST {path}")
        return resp


class HttpStream:
    """One streamed generation (see `inference.backend.TokenStream`), read in a task at once.

    `cancel` closes the HTTP stream, which makes the server abort the request;
    the result keeps what arrived, with finish_reason "cancelled" and the
    version the request was admitted on. A failure (including an abort by a
    drain timeout) raises `BackendError` from `tokens` and `result`.
    """

    def __init__(self, backend: HttpBackend, request: GenerateRequest) -> None:
        self._backend = backend
        self._request = request
        self._queue: asyncio.Queue[tuple[int, float] | None] = asyncio.Queue()
        self._ids: list[int] = []
        self._lps: list[float] = []
        self._version = backend.version
        self._cancelled = False
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"{backend.name}-stream"
        )

    async def _run(self) -> GenerateResult:
        try:
            async with self._backend.admitted() as version:
                self._version = version
                finish = await self._backend._abortable(self._receive())
            return GenerateResult(self._ids, self._lps, finish, version)
        except asyncio.CancelledError:
            if not self._cancelled:
                raise
            return self._partial()
        finally:
            self._queue.put_nowait(None)

    async def _receive(self) -> FinishReason:
        finish: FinishReason | None = None
        async for tokens, reason in self._backend._stream_tokens(self._request):
            for token, logprob in tokens:
                self._ids.append(token)
                self._lps.append(logprob)
                self._queue.put_nowait((token, logprob))
            finish = reason or finish
        if finish is None:
            raise BackendError(f"{self._backend.name} stream ended without a finish_reason")
        return finish

    def _partial(self) -> GenerateResult:
        return GenerateResult(self._ids, self._lps, "cancelled", self._version)

    async def tokens(self) -> AsyncIterator[tuple[int, float]]:
        while (item := await self._queue.get()) is not None:
            yield item
        await self.result()  # raises the stream's BackendError, if it failed

    def cancel(self) -> None:
        if not self._task.done():
            self._cancelled = True
            self._task.cancel()
            self._queue.put_nowait(None)  # the task may be cancelled before it ever ran

    async def result(self) -> GenerateResult:
        try:
            return await asyncio.shield(self._task)
        except asyncio.CancelledError:
            if not (self._cancelled and self._task.cancelled()):
                raise  # our caller is being cancelled, not the stream
            return self._partial()
