"""The shared body of every HTTP inference backend: pool, admission gate, swaps, streams.

A server-specific backend (`inference.vllm_http`, `inference.sglang_http`)
subclasses `HttpBackend` and says only how its server differs: the request
it sends for one generation (`_complete`, `_stream_tokens`), how it reads the
answer (and the server's per-token version labels, if it gives them), the
calls that pause (with the swap's `SwapPolicy`), reload and resume it, and
those that load and unload a LoRA adapter (`_load_adapter`,
`_unload_adapter`). Everything that decides *when* things happen lives here,
so every HTTP backend keeps the same ordering contract (below), in both swap
modes, for the base weights and for each adapter. The module is long because
that contract is one piece: admission, drain, the keep-mode marks and the
streams that carry them.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import contextvars
import logging
from collections.abc import AsyncIterator, Coroutine, Iterable
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, Self, TypeVar

import aiohttp
import httpx
import yarl

from inference.backend import BackendError, VersionMoved
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
from inference.types import (
    DRAIN,
    KEEP,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    SwapPolicy,
    VersionStarts,
    result_with_marks,
)
from inference.weight_source import CollectiveSource, saved

logger = logging.getLogger(__name__)

T = TypeVar("T")

Tokens = list[tuple[int, float]]  # (token id, logprob) pairs, in sampling order

# What a PEFT adapter directory must hold (peft's `save_pretrained`).
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class Lane:
    """The requests one swap acts on: all of a backend's, or those of one adapter.

    `gate` is cleared while the swap runs (new requests wait); `idle` is set
    when none of the lane's admitted requests is in flight; `running` holds
    their calls, so a drain timeout can abort them (`aborted`). `flights` are
    the requests in flight that report this lane's version (a keep-mode swap
    marks them), `received` counts the tokens they have received (its settle
    watches it).
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
        self.flights: set[Flight] = set()
        self.received = 0
        self.lock = asyncio.Lock()  # one swap of this lane at a time

    def enter(self) -> None:
        self.inflight += 1
        self.idle.clear()

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.idle.set()


class Flight:
    """One admitted request as a keep-mode swap sees it.

    `marks` are (token index, version) pairs for `result_with_marks`: the
    version it was admitted on, then one per keep-mode swap it lived through,
    at the number of tokens it had received when the swap marked it.
    `streamed`: its tokens arrive one event at a time, so that number is the
    index where the new version began; a non-streaming call cannot be marked
    so and relies on the server's labels.
    """

    __slots__ = ("lane", "lanes", "marks", "received", "streamed", "swapped")

    def __init__(self, lanes: tuple[Lane, ...], streamed: bool) -> None:
        self.lanes = lanes
        self.lane = lanes[-1]  # the lane whose version it reports
        self.marks = [(0, self.lane.version)]
        self.received = 0
        self.streamed = streamed
        self.swapped = False

    @property
    def version(self) -> int:
        """The version it was admitted on."""
        return self.marks[0][1]

    def got(self, n: int) -> None:
        self.received += n
        self.lane.received += n

    def mark(self, version: int) -> None:
        """Tokens from the next one received on were sampled by `version`."""
        self.marks.append((self.received, version))
        self.swapped = True

    def result(
        self, ids: list[int], lps: list[float], finish: FinishReason, server: VersionStarts | None
    ) -> GenerateResult:
        """The completion; the server's labels (`server`) win over the marks. Tokens before
        the first labelled one (starts after 0: the server's label then was none of
        rlgate's) were sampled by the version it was admitted on."""
        if server:
            marks = list(server)
            if marks[0][0] > 0:
                marks.insert(0, (0, self.version))
            try:
                return result_with_marks(ids, lps, finish, marks)
            except ValueError:  # an older version than admitted: not labels of this lane
                logger.warning("server labels %s do not fit v%d; using marks", server, self.version)
        if self.swapped and not self.streamed:
            raise BackendError(
                "a keep-mode swap happened during a non-streaming call whose answer "
                "labels no tokens: the version of each token is unknown"
            )
        return result_with_marks(ids, lps, finish, self.marks)


class Completion(NamedTuple):
    """What `_complete` may return: its tokens, finish reason, and the server's labels."""

    tokens: Tokens
    finish: FinishReason
    starts: VersionStarts | None = None  # where each version began, from the server's labels


class StreamEvent(NamedTuple):
    """What `_stream_tokens` may yield: the new tokens, the finish reason if any, and the
    server's labels of the whole output (usually on the last event only)."""

    tokens: Tokens
    finish: FinishReason | None
    starts: VersionStarts | None = None


# The backend whose server this task holds paused for a keep-mode swap: a nested
# `_server_paused` (a subclass's adapter load) finds it paused already.
_PAUSED_BY: contextvars.ContextVar[HttpBackend | None] = contextvars.ContextVar(
    "rlgate_http_paused_by", default=None
)


class HttpBackend(abc.ABC):
    """A `Backend` over one inference server's HTTP API.

    Hot swap, the ordering contract. `load_weights(source, version, policy)`
    with `policy.mode == "keep"` (the default):

    1. closes this backend's admission gate: new requests wait (nothing
       fails); requests in flight go on, and nothing waits for them;
    2. pauses the server with the policy (`_pause`): it freezes the requests
       it is generating between two tokens (`clear_kv`: their KV cache is
       recomputed by the new weights after the resume);
    3. loads the weights in place (`_reload`, or `_receive` from a
       collective) and meanwhile, unless the server labels tokens, settles:
       waits until no stream of the lane has received a token for
       `config.pause_settle_s`, so every token sampled before the pause has
       arrived (the server is paused: none sampled after it can arrive);
    4. marks each request in flight: the tokens it receives from now on were
       sampled by `version` (only if the load succeeded);
    5. bumps `version` (only if the load succeeded), resumes the server (even
       after a failed load: `_resume`), opens the gate.

    A request reads `version` when it is admitted; its result says where each
    later version began (`GenerateResult.version_starts`, built by
    `result_with_marks`). When the server labels each token with its weights
    version (`labels_tokens`: `_complete` returns a `Completion`,
    `_stream_tokens` yields a `StreamEvent` with `starts`), those labels win
    over the marks. A server that labels no tokens has every non-streaming
    call sent as a stream internally (`generate`), so that a swap can mark
    it too: an SSE event per token instead of one JSON body, a little more
    CPU and bytes per call. The marks rely on the settle: a token sampled
    before the pause that arrives after `pause_settle_s` of silence would be
    labelled with the new version. A server that labels tokens gets no settle
    (its gate opens as soon as it has loaded), so there the marks are only the
    fallback for an answer whose labels are missing, late by any tokens still
    in transit; a non-streaming call with no usable labels after a keep-mode
    swap cannot be marked at all and fails with `BackendError`.

    `policy.mode == "drain"`: step 1, then waits until every request it
    admitted has finished, up to `config.drain_timeout_s`, then pauses
    (`_pause` with the policy), reloads, resumes, bumps. No request of this
    client is in flight while the weights change, so a completion never
    mixes versions.

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
    has a lane of its own: its version, gate and in-flight requests. A
    request naming an adapter is admitted through the backend's gate and then
    the adapter's, and reports the adapter's version. `load_adapter` runs the
    same steps on that lane: it closes the adapter's gate; with `drain` it
    drains the adapter's requests (same timeout policy) and has the server
    load the adapter (`_load_adapter`) while other adapters and the base
    model keep serving, unless the server itself must pause for the load
    (vLLM, reloading from the same directory: `VLLMBackend`); with `keep` no
    server here pauses one adapter alone, so the whole server pauses for the
    load (every request on it freezes for that long; only the adapter's are
    marked and bumped). Then it bumps the adapter's version and opens the
    gate. `unload_adapter` closes and drains the lane, has the server drop
    the adapter and forgets the lane: requests naming it then fail with
    `BackendError`. When the server's reload of an adapter is not atomic
    (`adapter_reload_atomic` False: an unload then a load) and fails, the
    adapter is forgotten rather than served at an unknown version.

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
    # True when the server labels each token with the weights version that sampled it and
    # `_complete` / `_stream_tokens` report those labels (their `starts`); False: `generate`
    # streams internally so that a keep-mode swap can mark where the new version began.
    labels_tokens: ClassVar[bool] = False

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
    async def _complete(self, request: GenerateRequest) -> Completion:
        """One non-streaming generation: its tokens and finish reason, and the server's
        per-token version labels when it gives them (a `Completion` with `starts`).
        Called only when `labels_tokens` is True."""

    @abc.abstractmethod
    def _stream_tokens(self, request: GenerateRequest) -> AsyncIterator[StreamEvent]:
        """One streaming generation: per event, the NEW tokens and the finish reason if any;
        a `StreamEvent` may carry the server's labels of the whole output (the last does)."""

    async def _check_checkpoint(self, checkpoint_dir: Path, version: int) -> Path:
        """Refuse a checkpoint the server cannot load, before anything is paused."""
        return checkpoint_dir

    @abc.abstractmethod
    async def _pause(self, policy: SwapPolicy) -> None:
        """Stop the server generating for a swap, other clients' requests included.

        `keep`: requests in flight freeze between two tokens and go on after `_resume`
        (`clear_kv`: their KV cache is recomputed then). `drain`: called after the drain;
        what the server does with other clients' requests is its own pause's default.
        """

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
        if not self.labels_tokens:  # only a stream can be marked by a keep-mode swap
            stream = HttpStream(self, request, queue_tokens=False)
            try:
                return await stream.result()
            except asyncio.CancelledError:
                stream.cancel()
                raise
        async with self.admitted(
            request.adapter, streamed=False, version=request.version
        ) as flight:
            answer = await self._abortable(self._complete(request), flight.lanes)
        tokens, finish, starts = answer
        if finish is None:
            raise BackendError(f"{self.name} answered without a finish_reason")
        return flight.result([t for t, _ in tokens], [lp for _, lp in tokens], finish, starts)

    def start_stream(self, request: GenerateRequest) -> HttpStream:
        if not request.prompt_token_ids:
            raise BackendError("empty prompt")
        return HttpStream(self, request)

    async def load_weights(
        self, checkpoint_dir: Path | CollectiveSource, version: int, policy: SwapPolicy = KEEP
    ) -> None:
        """Swap in place, in the order of the class docstring; the load receives the weights
        from the trainer instead of reloading them when given a `CollectiveSource`."""
        source = await self._checked_source(checkpoint_dir, version)
        async with self.quiesced(f"load v{version}", policy):
            await self._swap_paused(source, version, policy)

    @contextlib.asynccontextmanager
    async def quiesced(self, what: str, policy: SwapPolicy = KEEP) -> AsyncIterator[None]:
        """The gate closed until the block exits; with `drain`, also none of this client's
        requests in flight (`what` names the reason in the drain's log). With `keep` they
        go on: a reload inside pauses them on the server.

        For a swap that several clients of one server must agree on
        (`gateway.control.swap_barrier`): inside, `reload_quiesced` reloads the server
        and `set_version` adopts a version that another client had it load.
        """
        async with self._swap_lock:
            self._base.gate.clear()
            try:
                if policy.mode == "drain":
                    await self._drain(self._base, what)
                yield
            finally:
                self._base.gate.set()

    async def reload_quiesced(
        self, source: Path | CollectiveSource, version: int, policy: SwapPolicy = KEEP
    ) -> None:
        """Pause, load, (keep) mark, bump, resume; the caller holds `quiesced` with the same
        `policy`."""
        await self._swap_paused(await self._checked_source(source, version), version, policy)

    def set_version(self, version: int) -> None:
        """Label later requests `version` without reloading: another client of the same
        server had it load that version. The caller holds `quiesced`.

        Requests still in flight (a keep-mode swap) are marked as going on at `version`
        from their next token. No settle precedes the mark here, so unless the server
        labels tokens the index is exact only when this runs while the other client
        holds the server paused.
        """
        for flight in self._base.flights:
            if flight.lane is self._base:
                flight.mark(version)
        self._base.version = version

    async def _checked_source(
        self, source: Path | CollectiveSource, version: int
    ) -> Path | CollectiveSource:
        if isinstance(source, CollectiveSource):
            return source
        return await self._check_checkpoint(Path(source), version)

    async def _swap_paused(
        self, source: Path | CollectiveSource, version: int, policy: SwapPolicy
    ) -> None:
        """Pause, load, resume (even after a failed load); the marks and the version only if
        it loaded."""
        async with self._paused_for(policy):
            if policy.mode == "keep":
                await self._load_keeping(self._base, self._load(source, version), version)
            else:
                await self._load(source, version)
            self._base.version = version
        logger.info(
            "%s at %s serves version %d (%s, %s)", self.name, self.url, version, source, policy
        )

    @contextlib.asynccontextmanager
    async def _paused_for(self, policy: SwapPolicy) -> AsyncIterator[None]:
        """The server paused with `policy` until the block exits, then resumed."""
        await self._pause(policy)
        token = _PAUSED_BY.set(self)
        try:
            yield
        finally:
            _PAUSED_BY.reset(token)
            await self._resume()

    async def _load_keeping(
        self, lane: Lane, load: Coroutine[Any, Any, None], version: int
    ) -> None:
        """A keep-mode swap's load on the paused server: the settle alongside it, then each
        of `lane`'s requests in flight marked as going on at `version`."""
        settle = asyncio.ensure_future(self._settle(lane))
        try:
            await load
            await settle
        finally:
            settle.cancel()
        for flight in lane.flights:
            if flight.lane is lane:
                flight.mark(version)

    async def _settle(self, lane: Lane) -> None:
        """Until no stream of `lane` has received a token for `config.pause_settle_s` (the
        server is paused: what still arrives was sampled before the pause). Nothing to wait
        for when the server labels tokens or none of the lane's requests is in flight."""
        if self.labels_tokens or not lane.flights:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.control_timeout_s
        seen = lane.received
        while True:
            await asyncio.sleep(self.config.pause_settle_s)
            if lane.received == seen:
                return
            if loop.time() > deadline:
                logger.warning("%s: tokens still arriving while paused; marking anyway", self)
                return
            seen = lane.received

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

    async def load_adapter(
        self, name: str, adapter_dir: Path, version: int, policy: SwapPolicy = KEEP
    ) -> None:
        """Load or replace adapter `name`, in the order of the class docstring.

        A `keep` replacement pauses the whole server (with `policy`) for the load: no
        server here pauses one adapter's requests alone. Every request on the server
        freezes meanwhile; only the adapter's are marked as going on at `version`.
        """
        adapter_dir = await self._check_adapter_dir(Path(adapter_dir), name, version)
        async with self._adapter_lock(name):
            lane = self._adapters.get(name)
            if lane is None:  # nothing can be admitted for it yet: no gate to close
                await self._load_adapter(name, adapter_dir, replace=False)
                self._adapters[name] = Lane(version)
            else:
                lane.gate.clear()
                try:
                    if policy.mode == "drain":
                        await self._drain(lane, f"load adapter {name!r} v{version}")
                        await self._replace_adapter(lane, name, adapter_dir)
                        lane.version = version
                    else:
                        async with self._swap_lock, self._paused_for(policy):
                            replace = self._replace_adapter(lane, name, adapter_dir)
                            await self._load_keeping(lane, replace, version)
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

    async def _replace_adapter(self, lane: Lane, name: str, adapter_dir: Path) -> None:
        """The server's load over adapter `name`; a failed non-atomic one forgets it."""
        try:
            await self._load_adapter(name, adapter_dir, replace=True)
        except BaseException:
            if not self.adapter_reload_atomic and self._adapters.get(name) is lane:
                del self._adapters[name]  # the server may have dropped it
            raise

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
        self, adapter: str | None = None, streamed: bool = True, version: int | None = None
    ) -> AsyncIterator[Flight]:
        """Hold a place among the in-flight requests (of `adapter`, if named).

        Yields the request's `Flight`: the version it was admitted on, the lanes it holds
        (for `_abortable`) and the marks of the keep-mode swaps it lives through.
        Raises `BackendError` if `adapter` is not loaded, and `VersionMoved` if `version`
        is given and its lane serves another (`GenerateRequest.version`).
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
        if version is not None and lanes[-1].version != version:
            raise VersionMoved(
                f"{self.name} at {self.url} serves v{lanes[-1].version}, not v{version}"
            )
        flight = Flight(lanes, streamed)
        for lane in lanes:
            lane.enter()
        flight.lane.flights.add(flight)
        try:
            yield flight
        finally:
            flight.lane.flights.discard(flight)
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
    async def _server_paused(self, policy: SwapPolicy = DRAIN) -> AsyncIterator[None]:
        """The server paused for a change that needs it idle (one at a time with weight swaps);
        inside a keep-mode swap of this task, which holds it paused already, a no-op."""
        if _PAUSED_BY.get() is self:
            yield
            return
        async with self._swap_lock, self._paused_for(policy):
            yield

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
    versions that sampled it. A failure (including an abort by a drain
    timeout) raises `BackendError` from `tokens` and `result`.
    `queue_tokens` False: only the result is wanted (`HttpBackend.generate`).
    """

    def __init__(
        self, backend: HttpBackend, request: GenerateRequest, queue_tokens: bool = True
    ) -> None:
        self._backend = backend
        self._request = request
        self._queue: asyncio.Queue[tuple[int, float] | None] = asyncio.Queue()
        self._queue_tokens = queue_tokens
        self._ids: list[int] = []
        self._lps: list[float] = []
        self._version = backend.version_for(request)
        self._flight: Flight | None = None
        self._cancelled = False
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"{backend.name}-stream"
        )

    async def _run(self) -> GenerateResult:
        try:
            request = self._request
            async with self._backend.admitted(request.adapter, version=request.version) as flight:
                self._flight = flight
                finish, starts = await self._backend._abortable(self._receive(flight), flight.lanes)
            return flight.result(self._ids, self._lps, finish, starts)
        except asyncio.CancelledError:
            if not self._cancelled:
                raise
            return self._partial()
        finally:
            self._queue.put_nowait(None)

    async def _receive(self, flight: Flight) -> tuple[FinishReason, VersionStarts | None]:
        finish: FinishReason | None = None
        labels: VersionStarts | None = None
        async for tokens, reason, starts in self._backend._stream_tokens(self._request):
            for token, logprob in tokens:
                self._ids.append(token)
                self._lps.append(logprob)
                if self._queue_tokens:
                    self._queue.put_nowait((token, logprob))
            flight.got(len(tokens))
            finish = reason or finish
            labels = starts or labels
        if finish is None:
            raise BackendError(f"{self._backend.name} stream ended without a finish_reason")
        return finish, labels

    def _partial(self) -> GenerateResult:
        if self._flight is None:
            return GenerateResult(self._ids, self._lps, "cancelled", self._version)
        return result_with_marks(self._ids, self._lps, "cancelled", self._flight.marks)

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
