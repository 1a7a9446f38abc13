"""The shared body of every HTTP inference backend: pool, admission gate, drain, swap, streams.

A server-specific backend (`inference.vllm_http`, `inference.sglang_http`)
subclasses `HttpBackend` and says only how its server differs: the request
it sends for one generation (`_complete`, `_stream_tokens`), how it reads the
answer, the calls that pause, reload and resume it, and those that load and
unload a LoRA adapter (`_load_adapter`, `_unload_adapter`). Everything that
decides *when* things happen lives here, so every HTTP backend keeps the
same ordering contract (below), for the base weights and for each adapter.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine, Iterable
from pathlib import Path
from typing import Any, ClassVar, Self, TypeVar

import aiohttp
import httpx
import yarl

from inference.backend import BackendError
from inference.http_common import (
    HttpBackendConfig,
    ServerCredentials,
    check_response,
    check_status,
    end_stream,
    iter_sse,
    json_answer,
    make_client,
    make_session,
    post_json,
    transport_errors,
)
from inference.types import FinishReason, GenerateRequest, GenerateResult
from inference.weight_source import CollectiveSource, saved

logger = logging.getLogger(__name__)

T = TypeVar("T")

Tokens = list[tuple[int, float]]  # (token id, logprob) pairs, in sampling order

# What a PEFT adapter directory must hold (peft's `save_pretrained`).
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class Lane:
    """The requests one swap drains: all of a backend's, or those of one adapter.

    `gate` is cleared while the swap runs (new requests wait); `idle` is set
    when none of the lane's admitted requests is in flight; `running` holds
    their calls, so a drain timeout can abort them (`aborted`).
    """

    def __init__(self, version: int) -> None:
        self.version = version
        self.gate = asyncio.Event()
        self.gate.set()
        self.idle = asyncio.Event()
        self.idle.set()
        self.inflight = 0
        self.running: set[asyncio.Future[Any]] = set()
        self.aborted: set[asyncio.Future[Any]] = set()
        self.lock = asyncio.Lock()  # one swap of this lane at a time

    def enter(self) -> None:
        self.inflight += 1
        self.idle.clear()

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.idle.set()


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
    the new version back indefinitely; `ReplicaSet` and `SwapLoop` both
    expect a load that comes after a bounded wait.

    LoRA adapters (`inference.backend.AdapterBackend`). Each loaded adapter
    has a lane of its own: its version, gate and in-flight count. A request
    naming an adapter is admitted through the backend's gate and then the
    adapter's, and reports the adapter's version. `load_adapter` runs the
    same four steps on that lane only: it closes the adapter's gate, drains
    the adapter's requests (same timeout policy), has the server load the
    adapter (`_load_adapter`), bumps the adapter's version and opens the
    gate. Other adapters and the base model keep serving throughout, unless
    the server itself must pause for the load (vLLM, reloading from the same
    directory: `VLLMBackend`). `unload_adapter` closes and drains the lane,
    has the server drop the adapter and forgets the lane: requests naming it
    then fail with `BackendError`. When the server's reload of an adapter is
    not atomic (`adapter_reload_atomic` False: an unload then a load) and
    fails, the adapter is forgotten rather than served at an unknown version.

    Clients. The sampling calls (`_post`, `_events`) go through an aiohttp
    session, made on first use inside the running loop: the gateway forwards
    every generation this way, and httpx cost several times as much CPU per
    request. Control calls, health and model listing stay on httpx. A test that
    injects an httpx `transport` gets httpx for everything, so a
    `httpx.MockTransport` still sees every request.
    """

    name: ClassVar[str] = "HTTP server"  # the server's name in errors and logs, e.g. "vLLM"
    # True when the server replaces a loaded adapter in one step that either
    # succeeds or leaves the old one (vLLM's load_inplace); False: unload, then load.
    adapter_reload_atomic: ClassVar[bool] = False

    def __init__(
        self,
        config: HttpBackendConfig,
        version: int = 0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.config = config
        self._client = make_client(config, transport)
        self._aiohttp = transport is None  # an injected transport sees every request
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[str, yarl.URL] = {}  # parsed once per path
        self._base = Lane(version)  # every admitted request, whatever its adapter
        self._swap_lock = self._base.lock  # held while the server's base weights change
        self._adapters: dict[str, Lane] = {}  # loaded adapters by name
        self._adapter_locks: dict[str, asyncio.Lock] = {}  # one load/unload per name at a time

    @classmethod
    def for_url(
        cls, url: str, version: int = 0, credentials: ServerCredentials | None = None
    ) -> Self:
        """The backend of the server at `url` with default settings, serving `version`."""
        config = HttpBackendConfig(base_url=url, credentials=credentials or ServerCredentials())
        return cls(config, version=version)

    @property
    def version(self) -> int:
        return self._base.version

    @property
    def url(self) -> str:
        return self.config.base_url

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}, version={self._base.version})"

    def adapter_version(self, name: str) -> int | None:
        lane = self._adapters.get(name)
        return lane.version if lane is not None else None

    @property
    def adapters(self) -> dict[str, int]:
        """The loaded adapters and their versions."""
        return {name: lane.version for name, lane in self._adapters.items()}

    def version_for(self, request: GenerateRequest) -> int:
        """The version that would serve `request` now (its adapter's, if it names one)."""
        if request.adapter is None:
            return self._base.version
        return self.adapter_version(request.adapter) or 0

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

    async def _receive(self, source: CollectiveSource, version: int) -> None:
        """Receive `version` from the trainer over a collective into the paused server, all or
        nothing (`weight_sync: collective`, docs/weight-sync.md)."""
        raise BackendError(f"{self.name} backend cannot receive weights over a collective")

    @abc.abstractmethod
    async def _resume(self) -> None:
        """Let the server generate again (also after a failed reload)."""

    async def _load_adapter(self, name: str, adapter_dir: Path, replace: bool) -> None:
        """Have the server serve `adapter_dir` as adapter `name` (`replace`: it serves one now).

        Called with the adapter's requests drained; other requests may be running.
        """
        raise BackendError(f"{self.name} backend does not serve LoRA adapters")

    async def _unload_adapter(self, name: str) -> None:
        """Have the server drop adapter `name` (its requests drained)."""
        raise BackendError(f"{self.name} backend does not serve LoRA adapters")

    # --- the Backend interface --------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if not request.prompt_token_ids:
            raise BackendError("empty prompt")
        async with self.admitted(request.adapter) as (version, lanes):
            tokens, finish = await self._abortable(self._complete(request), lanes)
        return GenerateResult([t for t, _ in tokens], [lp for _, lp in tokens], finish, version)

    def start_stream(self, request: GenerateRequest) -> HttpStream:
        if not request.prompt_token_ids:
            raise BackendError("empty prompt")
        return HttpStream(self, request)

    async def load_weights(self, checkpoint_dir: Path | CollectiveSource, version: int) -> None:
        """Swap in place, in the order of the class docstring; step 3 receives the weights
        from the trainer instead of reloading them when given a `CollectiveSource`."""
        source = await self._checked_source(checkpoint_dir, version)
        async with self.quiesced(f"load v{version}"):
            await self._swap_paused(source, version)

    @contextlib.asynccontextmanager
    async def quiesced(self, what: str) -> AsyncIterator[None]:
        """Steps 1 and 2 held open: the gate closed and none of this client's requests in
        flight (`what` names the reason in the drain's log), until the block exits.

        For a swap that several clients of one server must agree on
        (`gateway.control.swap_barrier`): inside, `reload_quiesced` reloads the server
        and `set_version` adopts a version that another client had it load.
        """
        async with self._swap_lock:
            self._base.gate.clear()
            try:
                await self._drain(self._base, what)
                yield
            finally:
                self._base.gate.set()

    async def reload_quiesced(self, source: Path | CollectiveSource, version: int) -> None:
        """Steps 3 and 4 of `load_weights`; the caller holds `quiesced`."""
        await self._swap_paused(await self._checked_source(source, version), version)

    def set_version(self, version: int) -> None:
        """Label later requests `version` without reloading: another client of the same
        server had it load that version. The caller holds `quiesced`."""
        self._base.version = version

    async def _checked_source(
        self, source: Path | CollectiveSource, version: int
    ) -> Path | CollectiveSource:
        if isinstance(source, CollectiveSource):
            return source
        return await self._check_checkpoint(Path(source), version)

    async def _swap_paused(self, source: Path | CollectiveSource, version: int) -> None:
        """Pause, load, resume (even after a failed load); the version only if it loaded."""
        await self._pause()
        try:
            await self._load(source, version)
            self._base.version = version
        finally:
            await self._resume()
        logger.info("%s at %s serves version %d (%s)", self.name, self.url, version, source)

    async def _load(self, source: Path | CollectiveSource, version: int) -> None:
        """The paused server's load; a failed receive falls back to the checkpoint if saved."""
        if not isinstance(source, CollectiveSource):
            await self._reload(source, version)
            return
        try:
            await self._receive(source, version)
        except BackendError as exc:
            if not await asyncio.to_thread(saved, source.checkpoint_dir):
                raise
            logger.warning("%s: v%d over the collective failed (%s); from disk", self, version, exc)
            await self._reload(
                await self._check_checkpoint(source.checkpoint_dir, version), version
            )

    async def load_adapter(self, name: str, adapter_dir: Path, version: int) -> None:
        """Load or replace adapter `name`, in the order of the class docstring."""
        adapter_dir = await self._check_adapter_dir(Path(adapter_dir), name, version)
        async with self._adapter_lock(name):
            lane = self._adapters.get(name)
            if lane is None:  # nothing can be admitted for it yet: no gate to close
                await self._load_adapter(name, adapter_dir, replace=False)
                self._adapters[name] = Lane(version)
            else:
                lane.gate.clear()
                try:
                    await self._drain(lane, f"load adapter {name!r} v{version}")
                    try:
                        await self._load_adapter(name, adapter_dir, replace=True)
                    except BaseException:
                        if not self.adapter_reload_atomic:
                            del self._adapters[name]  # the server may have dropped it
                        raise
                    lane.version = version
                finally:
                    lane.gate.set()
        logger.info(
            "%s at %s serves adapter %r version %d (%s)",
            self.name,
            self.url,
            name,
            version,
            adapter_dir,
        )

    async def unload_adapter(self, name: str) -> None:
        """Drain adapter `name`'s requests, drop it on the server, forget it."""
        async with self._adapter_lock(name):
            lane = self._adapters.get(name)
            if lane is None:
                raise BackendError(f"{self.name} at {self.url}: adapter {name!r} is not loaded")
            lane.gate.clear()
            try:
                await self._drain(lane, f"unload adapter {name!r}")
                await self._unload_adapter(name)
                del self._adapters[name]
            finally:
                lane.gate.set()  # its waiters find the adapter gone and fail
        logger.info("%s at %s no longer serves adapter %r", self.name, self.url, name)

    async def served_context(self) -> int | None:
        """The server's own context limit, if its API reports one (None: the model's)."""
        return None

    async def health(self) -> bool:
        try:
            resp = await self._client.get("/health", timeout=self.config.connect_timeout_s)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def close(self) -> None:
        await self._client.aclose()
        if self._session is not None:
            await self._session.close()
            self._session = None

    # --- admission and drain ------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def admitted(
        self, adapter: str | None = None
    ) -> AsyncIterator[tuple[int, tuple[Lane, ...]]]:
        """Hold a place among the in-flight requests (of `adapter`, if named).

        Yields the version that will serve the request and the lanes it holds
        (for `_abortable`). Raises `BackendError` if `adapter` is not loaded.
        """
        while True:  # both gates open at the same moment (a swap may start while we wait)
            if not self._base.gate.is_set():
                await self._base.gate.wait()
                continue
            lanes: tuple[Lane, ...] = (self._base,)
            if adapter is not None:
                lane = self._adapters.get(adapter)
                if lane is None:
                    raise BackendError(
                        f"{self.name} at {self.url}: adapter {adapter!r} is not loaded"
                    )
                if not lane.gate.is_set():
                    await lane.gate.wait()
                    continue
                lanes = (self._base, lane)
            break
        for lane in lanes:
            lane.enter()
        try:
            yield lanes[-1].version, lanes
        finally:
            for lane in lanes:
                lane.leave()

    async def _abortable(self, call: Coroutine[Any, Any, T], lanes: Iterable[Lane]) -> T:
        """Run an admitted request's call so that a drain timeout of its lanes can abort it."""
        lanes = tuple(lanes)
        task = asyncio.ensure_future(call)
        for lane in lanes:
            lane.running.add(task)
        try:
            return await task
        except asyncio.CancelledError:
            me = asyncio.current_task()
            aborted = any(task in lane.aborted for lane in lanes)
            if not aborted or (me is not None and me.cancelling()):
                raise  # our caller was cancelled (a stream's `cancel`, a disconnect)
            raise BackendError(
                f"{self.name} at {self.url}: aborted after the drain timeout of a weight swap"
            ) from None
        finally:
            for lane in lanes:
                lane.running.discard(task)
                lane.aborted.discard(task)

    async def _drain(self, lane: Lane, what: str) -> None:
        """Until none of `lane`'s requests is in flight; at the timeout, abort the stragglers."""
        try:
            await asyncio.wait_for(lane.idle.wait(), self.config.drain_timeout_s)
            return
        except TimeoutError:
            pass
        stragglers = list(lane.running)
        logger.warning(
            "%s at %s: %d requests still running after %.0f s; aborting them to %s",
            self.name,
            self.url,
            len(stragglers),
            self.config.drain_timeout_s,
            what,
        )
        lane.aborted.update(stragglers)
        for task in stragglers:
            task.cancel()
        await lane.idle.wait()  # they unwind at once: their calls were cancelled

    def _adapter_lock(self, name: str) -> asyncio.Lock:
        return self._adapter_locks.setdefault(name, asyncio.Lock())

    async def _check_adapter_dir(self, adapter_dir: Path, name: str, version: int) -> Path:
        """Refuse a directory that is not a PEFT adapter, before any gate closes."""
        if not name:
            raise BackendError("an adapter needs a non-empty name")
        adapter_dir = adapter_dir.resolve()
        missing = await asyncio.to_thread(
            lambda: [f for f in ADAPTER_FILES if not (adapter_dir / f).is_file()]
        )
        if missing:
            raise BackendError(
                f"{adapter_dir} is not a PEFT adapter directory (no {', '.join(missing)}); "
                f"adapter {name!r} v{version} not loaded"
            )
        return adapter_dir

    @contextlib.asynccontextmanager
    async def _server_paused(self) -> AsyncIterator[None]:
        """The server paused for a change that needs it idle (one at a time with weight swaps)."""
        async with self._swap_lock:
            await self._pause()
            try:
                yield
            finally:
                await self._resume()

    # --- HTTP helpers for subclasses ----------------------------------------------------

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        """POST `body` to `path`; the answer's JSON (errors mapped as in `http_common`)."""
        session = self._sampling_session()
        with transport_errors(f"{self.name} at {self.url}"):
            if session is None:
                resp = await self._client.post(path, json=body)
                status, raw = resp.status_code, resp.content
            else:
                async with await post_json(session, self._url(path), body) as answer:
                    status, raw = answer.status, await answer.read()
        what = f"{self.name} POST {path}"
        if status >= 400:
            check_status(status, raw.decode(errors="replace"), what)
        return json_answer(raw, what)

    async def _events(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """POST `body` to `path` and yield the JSON events of its server-sent event stream.

        Leaving early (an error, a cancelled stream, the caller closing the generator)
        closes the connection, which makes the server abort the request.
        """
        what = f"{self.name} POST {path} (stream)"
        session = self._sampling_session()
        with transport_errors(f"{self.name} at {self.url}"):
            if session is None:
                async with self._client.stream("POST", path, json=body) as resp:
                    await check_response(resp, what)
                    async for event in iter_sse(resp.aiter_bytes()):
                        yield event
                return
            answer = await post_json(session, self._url(path), body)
            try:
                if answer.status >= 400:
                    detail = (await answer.read()).decode(errors="replace")
                    check_status(answer.status, detail, what)
                async for event in iter_sse(answer.content.iter_any()):
                    yield event
            except BaseException:
                answer.close()
                raise
            await end_stream(answer)

    def _sampling_session(self) -> aiohttp.ClientSession | None:
        """The aiohttp session of the sampling calls, made in the running loop on first use;
        None when a test injected an httpx transport (then `_client` serves them)."""
        if not self._aiohttp:
            return None
        if self._session is None:
            self._session = make_session(self.config)
        return self._session

    def _url(self, path: str) -> yarl.URL:
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = yarl.URL(self.config.base_url.rstrip("/") + path)
        return url

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
        self._version = backend.version_for(request)
        self._cancelled = False
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"{backend.name}-stream"
        )

    async def _run(self) -> GenerateResult:
        try:
            async with self._backend.admitted(self._request.adapter) as (version, lanes):
                self._version = version
                finish = await self._backend._abortable(self._receive(), lanes)
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
