"""Several inference servers behind one `Backend`: routing, health, failover, rolling swap.

Routing. A request goes to the routable replica (healthy, not drained for a
reload, and not paused for one unless every other is) with the fewest
outstanding requests; ties go to the one picked least
recently (round robin). A request with an `affinity` (the gateway passes the
episode id) goes back to the replica that served its episode before, for
prefix-cache reuse, as long as that replica is routable and has at most
`sticky_slack` more outstanding requests than the least-loaded one; otherwise
it goes to the least-loaded replica, which becomes the episode's new home.

Health. A background task asks every replica's `health()` each
`health_interval_s`. A replica that fails it, or whose request raised a
`BackendError` and then fails an immediate health probe, is taken out of
routing. When it answers healthy again it first gets the newest weights that
were loaded into the set (its server may have restarted on the base model),
then goes back into routing.

Failover, and why an answer is never stored twice. A request whose replica
fails before it returned anything (no result, no streamed token) is sent to
another replica, at most `max_attempts` replicas in all; nothing reached the
gateway from the failed attempt, so nothing of it is stored. A stream that
fails after it delivered a token is not retried: it ends with the error. When
no replica is routable the call raises `BackendError` (the gateway answers
503, retryable). `BackendOverloaded` from one replica moves the request to
another without taking the replica out.

Versions. Every result carries the versions of the replica that sampled it
(`GenerateResult.policy_version`, and `version_starts` when a keep-mode swap
happened during it), so replicas may briefly serve different versions;
`version` is the lowest version a routable replica serves.

Rolling swap. `load_weights` reloads one replica at a time, so the others
keep serving and there is no global pause; what a replica does with the
requests it is generating follows the swap's `SwapPolicy`:

* `keep` (the default): the replica reloads in place. New calls are routed
  to the other replicas while it is paused for the reload (a call waits on a
  paused server, for the reload only, when no other is routable, e.g. a
  retry after a failure elsewhere); its in-flight requests stay
  on it, pause between two tokens, and go on with the new version, each
  result saying where every version began (`GenerateResult.version_starts`).
* `drain`: the replica is taken out of routing, its outstanding requests
  finish on the old weights (up to `drain_timeout_s`), it loads, and it goes
  back in before the next one starts.

With a single routable replica the load happens in place either way, and
that backend's own ordering contract applies.

LoRA adapters (`inference.backend.AdapterBackend`, when every replica's
backend is one). A request naming an adapter goes only to replicas that
serve it. `load_adapter` rolls the same way, one replica at a time and with
the same `SwapPolicy` (passed to the replica's own `load_adapter`), but for
that adapter only: while a replica swaps it, the adapter's requests go to the
others (if none has it, they wait at that replica's adapter gate), and with
`drain` the replica's other traffic is untouched. A `keep` load pauses the
replica's whole server, so the replica is paused for routing meanwhile, as
for a weight reload. `unload_adapter` drops it everywhere.
A replica that comes back gets the set's newest weights, then every adapter
loaded into the set. `adapter_version` is the lowest version of the adapter
among the routable replicas that serve it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Generic, TypeVar

from core.config import ReplicaConfig
from inference.backend import (
    AdapterBackend,
    Backend,
    BackendError,
    BackendOverloaded,
    TokenStream,
    VersionMoved,
)
from inference.swap import ServerClient, WeightsSource
from inference.types import KEEP, GenerateRequest, GenerateResult, SwapPolicy

logger = logging.getLogger(__name__)

B = TypeVar("B", bound=Backend)  # the replicas' backend kind


@dataclass
class Replica(Generic[B]):
    """One server of the set and what the router knows about it."""

    name: str
    backend: B
    url: str | None = None
    healthy: bool = True
    loading: bool = False  # out of routing while a drain-mode roll drains and reloads it
    pauses: int = 0  # keep-mode loads under way (server paused): routed to only if no other
    outstanding: int = 0
    served: int = 0
    last_pick: int = 0  # when the router last chose it (a counter), for round-robin ties
    last_error: str | None = None
    failed_load: tuple[int, float] | None = None  # (version, when to try it again)
    swapping: set[str] = field(default_factory=set)  # adapters it is loading or unloading now
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    @property
    def routable(self) -> bool:
        return self.healthy and not self.loading

    @property
    def paused(self) -> bool:
        return self.pauses > 0

    @contextlib.contextmanager
    def pausing(self, policy: SwapPolicy) -> Iterator[None]:
        """Counted as paused while a load with `policy` runs, if it is a keep-mode one."""
        n = int(policy.mode == "keep")
        self.pauses += n
        try:
            yield
        finally:
            self.pauses -= n

    def adapter_version(self, name: str) -> int | None:
        backend = self.backend
        return backend.adapter_version(name) if isinstance(backend, AdapterBackend) else None

    def adapter_backend(self) -> AdapterBackend:
        """Its backend, which must serve adapters."""
        if not isinstance(self.backend, AdapterBackend):
            raise BackendError(f"replica {self.name} does not serve LoRA adapters")
        return self.backend


@dataclass(frozen=True)
class ReplicaStatus:
    """What the admin API shows per replica."""

    name: str
    url: str | None
    healthy: bool
    loading: bool
    version: int
    outstanding: int
    served: int
    last_error: str | None


class ReplicaSet(Generic[B]):
    """A `Backend` over named replica `Backend`s (see the module docstring for the rules).

    A set of `ServerClient`s (HTTP servers other gateway processes may share) also
    offers the swap's steps apart (`quiesced`, `reload_quiesced`, `set_versions`), for
    the barrier that agrees one reload with those processes. There `keep` closes every
    gate of the set (the barrier holds them shut until all processes agree) and each
    server pauses every client's requests for its reload; a server that cannot label
    tokens is drained instead (`shared_policy`).
    """

    def __init__(
        self,
        replicas: Sequence[tuple[str, B] | tuple[str, B, str | None]],
        config: ReplicaConfig | None = None,
    ) -> None:
        if not replicas:
            raise ValueError("a ReplicaSet needs at least one replica")
        self.config = config or ReplicaConfig()
        self._replicas: list[Replica[B]] = []
        for entry in replicas:
            url = entry[2] if len(entry) == 3 else None
            self._add(Replica(entry[0], entry[1], url))
        self._affinity: OrderedDict[str, str] = OrderedDict()
        self._picks = 0
        self._target: tuple[WeightsSource, int] | None = None  # newest weights loaded
        self._adapter_targets: dict[str, tuple[Path, int]] = {}  # adapters loaded into the set
        self._adapter_locks: dict[str, asyncio.Lock] = {}
        self._swap_lock_: asyncio.Lock | None = None
        self._monitor: asyncio.Task | None = None
        self._closed = False

    # --- the Backend protocol ---------------------------------------------------

    @property
    def version(self) -> int:
        pool = [r for r in self._replicas if r.routable] or self._replicas
        return min(r.backend.version for r in pool)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.start()
        if not request.prompt_token_ids:
            raise BackendError("empty prompt")
        tried: set[str] = set()
        last: BackendError | None = None
        for _ in range(self.config.max_attempts):
            replica = self._pick(request.affinity, tried, last, request.adapter)
            tried.add(replica.name)
            replica.outstanding += 1
            replica.served += 1
            try:
                return await replica.backend.generate(request)
            except BackendError as exc:
                last = exc
                await self._on_failure(replica, exc)
            finally:
                replica.outstanding -= 1
        assert last is not None
        raise last

    def start_stream(self, request: GenerateRequest) -> ReplicaStream[B]:
        self.start()
        if not request.prompt_token_ids:
            raise BackendError("empty prompt")
        return ReplicaStream(self, request)

    async def load_weights(
        self, checkpoint_dir: WeightsSource, version: int, policy: SwapPolicy = KEEP
    ) -> None:
        """Rolling reload, one replica at a time, `policy` as in the module docstring.

        Replicas that are out of routing are skipped: they get these weights
        when they come back. Raises `BackendError` after the roll if any
        replica failed to load; that replica keeps its old weights (or is taken
        out if it no longer answers), and its results say which version they are.
        It tries that version again only after `load_retry_s`.
        """
        async with self._swap_lock():

            async def reload(replica: Replica[B]) -> None:
                await self._reload_routed(replica, checkpoint_dir, version, policy)

            await self._roll(checkpoint_dir, version, reload)

    # --- a swap agreed with other clients of the same servers ---------------------

    @contextlib.asynccontextmanager
    async def quiesced(
        self: ReplicaSet[ServerClient], what: str, policy: SwapPolicy = KEEP
    ) -> AsyncIterator[None]:
        """Every replica's client with its gate closed until the block exits
        (`HttpBackend.quiesced`); no rolling swap meanwhile.

        `keep`: only the gates close; requests in flight go on (a reload inside, by
        this client or another, pauses them on their server). `drain`: also none of
        this client's requests in flight. A replica whose server does not label tokens
        is drained even under `keep` (`shared_policy`).
        """
        async with self._swap_lock(), contextlib.AsyncExitStack() as stack:
            for replica in list(self._replicas):
                shared = shared_policy(replica.backend, policy)
                await stack.enter_async_context(replica.backend.quiesced(what, shared))
            yield

    async def reload_quiesced(
        self: ReplicaSet[ServerClient],
        source: WeightsSource,
        version: int,
        policy: SwapPolicy = KEEP,
    ) -> None:
        """Load `version` into every healthy replica behind, one after another; the caller
        holds `quiesced` with the same `policy` (with `keep`, each server pauses the
        requests in flight on it, every client's, for its reload, and they go on with
        `version`). Failures as in `load_weights` (the replica keeps its weights)."""

        async def reload(replica: Replica[ServerClient]) -> None:
            shared = shared_policy(replica.backend, policy)
            await replica.backend.reload_quiesced(source, version, shared)

        await self._roll(source, version, reload)

    def set_versions(
        self: ReplicaSet[ServerClient],
        versions: dict[str, int],
        target: tuple[WeightsSource, int] | None,
    ) -> None:
        """Adopt the versions another client had the replicas load (by replica name), without
        reloading; the caller holds `quiesced`. `target`: the weights a returning replica gets."""
        for replica in self._replicas:
            if replica.name in versions:
                replica.backend.set_version(versions[replica.name])
        if target is not None:
            self._target = target

    def versions(self) -> dict[str, int]:
        """The version each replica's client labels its results with, by replica name."""
        return {r.name: r.backend.version for r in self._replicas}

    def adapter_version(self, name: str) -> int | None:
        versions = [
            v for r in self._replicas if r.routable and (v := r.adapter_version(name)) is not None
        ]
        return min(versions) if versions else None

    async def load_adapter(
        self, name: str, adapter_dir: Path, version: int, policy: SwapPolicy = KEEP
    ) -> None:
        """Load or replace adapter `name` on every healthy replica, one at a time, each
        with `policy` (the replica's own `load_adapter` keeps or drains its requests).

        Replicas out of routing get it when they come back. Raises
        `BackendError` after the roll if any replica failed; that replica
        keeps its old adapter (or none), and results say which version they are.
        """
        for replica in self._replicas:
            replica.adapter_backend()  # refuse before anything is loaded anywhere
        async with self._adapter_locks.setdefault(name, asyncio.Lock()):
            self._adapter_targets[name] = (Path(adapter_dir), version)
            failed: list[str] = []
            for replica in list(self._replicas):
                current = replica.adapter_version(name)
                if not replica.healthy or (current is not None and current >= version):
                    continue
                replica.swapping.add(name)
                try:
                    with replica.pausing(policy):  # a keep load pauses the whole server
                        backend = replica.adapter_backend()
                        await backend.load_adapter(name, adapter_dir, version, policy)
                except Exception as exc:
                    failed.append(replica.name)
                    await self._on_adapter_failure(
                        replica, f"load adapter {name!r} v{version}", exc
                    )
                finally:
                    replica.swapping.discard(name)
            if failed:
                raise BackendError(f"replicas {failed} could not load adapter {name!r} v{version}")

    async def unload_adapter(self, name: str) -> None:
        """Drop adapter `name` from every replica that serves it."""
        async with self._adapter_locks.setdefault(name, asyncio.Lock()):
            self._adapter_targets.pop(name, None)
            failed: list[str] = []
            for replica in list(self._replicas):
                if replica.adapter_version(name) is None:
                    continue
                replica.swapping.add(name)
                try:
                    await replica.adapter_backend().unload_adapter(name)
                except Exception as exc:
                    await self._on_adapter_failure(replica, f"unload adapter {name!r}", exc)
                    if replica.healthy:
                        failed.append(replica.name)
                finally:
                    replica.swapping.discard(name)
            if failed:
                raise BackendError(f"replicas {failed} could not unload adapter {name!r}")

    async def health(self) -> bool:
        return any(r.routable for r in self._replicas)

    async def close(self) -> None:
        self._closed = True
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
            self._monitor = None
        for replica in self._replicas:
            try:
                await replica.backend.close()
            except Exception:
                logger.exception("closing replica %s failed", replica.name)

    # --- membership and status ---------------------------------------------------

    def start(self) -> None:
        """Start the background health checks (needs a running event loop; idempotent)."""
        if self._monitor is None and not self._closed:
            self._monitor = asyncio.get_running_loop().create_task(
                self._watch(), name="replica-health"
            )

    async def add_replica(self, name: str, backend: B, url: str | None = None) -> None:
        """Add a replica; it routes once it answers health and has the set's newest weights.

        One that does not answer yet joins when a later health check finds it up.
        """
        replica = Replica(name, backend, url, healthy=False)
        self._add(replica)
        async with replica.lock:
            if await self._probe(replica):
                await self._readmit(replica)

    async def remove_replica(self, name: str) -> None:
        """Take a replica out of routing, let its requests finish, close it."""
        replica = self._get(name)
        if len(self._replicas) == 1:
            raise ValueError("cannot remove the last replica of a set")
        replica.loading = True
        await self._drain(replica)
        self._replicas.remove(replica)
        await replica.backend.close()

    def replica_status(self) -> list[dict[str, Any]]:
        return [
            asdict(
                ReplicaStatus(
                    r.name,
                    r.url,
                    r.healthy,
                    r.loading or r.paused,
                    r.backend.version,
                    r.outstanding,
                    r.served,
                    r.last_error,
                )
            )
            for r in self._replicas
        ]

    def _add(self, replica: Replica[B]) -> None:
        if any(r.name == replica.name for r in self._replicas):
            raise ValueError(f"replica {replica.name!r} already exists")
        self._replicas.append(replica)

    def _get(self, name: str) -> Replica[B]:
        for r in self._replicas:
            if r.name == name:
                return r
        raise KeyError(name)

    # --- routing -----------------------------------------------------------------

    def _pick(
        self,
        affinity: str | None,
        exclude: set[str],
        last: BackendError | None = None,
        adapter: str | None = None,
    ) -> Replica[B]:
        candidates = [r for r in self._replicas if r.routable and r.name not in exclude]
        if adapter is not None:
            serving = [r for r in candidates if r.adapter_version(adapter) is not None]
            # one that is swapping this adapter only if no other has it (the request then waits)
            candidates = [r for r in serving if adapter not in r.swapping] or serving
        # one paused for its reload only if no other can take it (the request then waits)
        candidates = [r for r in candidates if not r.paused] or candidates
        if not candidates:
            if last is not None:
                raise last
            if adapter is not None:
                raise BackendError(f"adapter {adapter!r} is not loaded on a healthy replica")
            raise BackendError("no healthy inference replica")
        least = min(candidates, key=lambda r: (r.outstanding, r.last_pick))
        chosen = least
        if affinity is not None:
            home = self._affinity.get(affinity)
            sticky = next((r for r in candidates if r.name == home), None)
            if (
                sticky is not None
                and sticky.outstanding <= least.outstanding + self.config.sticky_slack
            ):
                chosen = sticky
            self._affinity[affinity] = chosen.name
            self._affinity.move_to_end(affinity)
            while len(self._affinity) > self.config.max_affinities:
                self._affinity.popitem(last=False)
        self._picks += 1
        chosen.last_pick = self._picks
        return chosen

    # --- health and failure --------------------------------------------------------

    async def _probe(self, replica: Replica[B]) -> bool:
        try:
            return bool(
                await asyncio.wait_for(replica.backend.health(), self.config.health_timeout_s)
            )
        except Exception as exc:  # any failure to answer is unhealthy
            replica.last_error = f"health: {exc!r}"
            return False

    async def _on_failure(self, replica: Replica[B], exc: BackendError) -> None:
        """A request failed on `replica`: take it out if it no longer answers health checks."""
        replica.last_error = str(exc) or repr(exc)
        if isinstance(exc, BackendOverloaded | VersionMoved):  # busy or swapped, not down
            return
        if replica.healthy and not await self._probe(replica):
            self._take_out(replica, f"request failed: {exc}")

    async def _on_adapter_failure(self, replica: Replica[B], what: str, exc: Exception) -> None:
        replica.last_error = f"{what}: {exc}"
        logger.warning("replica %s failed to %s: %s", replica.name, what, exc)
        if not await self._probe(replica):
            self._take_out(replica, replica.last_error)

    def _take_out(self, replica: Replica[B], why: str) -> None:
        if replica.healthy:
            replica.healthy = False
            logger.warning("replica %s taken out of routing: %s", replica.name, why)

    async def _watch(self) -> None:
        while True:
            try:
                await asyncio.gather(*(self._check(r) for r in list(self._replicas)))
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("replica health pass failed")
            await asyncio.sleep(self.config.health_interval_s)

    async def _check(self, replica: Replica[B]) -> None:
        if replica.loading or replica.lock.locked():
            return  # a reload in progress owns this replica
        ok = await self._probe(replica)
        if not ok:
            self._take_out(replica, replica.last_error or "health check failed")
        elif not replica.healthy:
            async with replica.lock:
                await self._readmit(replica)

    async def _readmit(self, replica: Replica[B]) -> None:
        """Bring a replica that answers again up to the set's weights, then route to it."""
        if self._target is not None:
            ckpt, version = self._target
            try:
                await replica.backend.load_weights(ckpt, version)
            except Exception as exc:
                replica.last_error = f"reload on return: {exc}"
                logger.warning("replica %s answers but could not load v%d", replica.name, version)
                return
        for name, (adapter_dir, adapter_version) in list(self._adapter_targets.items()):
            try:  # its server may have restarted without them
                await replica.adapter_backend().load_adapter(name, adapter_dir, adapter_version)
            except Exception as exc:
                replica.last_error = f"adapter {name!r} on return: {exc}"
                logger.warning(
                    "replica %s answers but could not load adapter %r", replica.name, name
                )
                return
        replica.healthy = True
        logger.info(
            "replica %s back in routing (version %d)", replica.name, replica.backend.version
        )

    # --- rolling swap --------------------------------------------------------------

    async def _drain(self, replica: Replica[B]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_timeout_s
        while replica.outstanding > 0 and loop.time() < deadline:
            await asyncio.sleep(0.01)
        if replica.outstanding > 0:
            logger.warning(
                "replica %s still has %d requests after %.0f s; loading anyway",
                replica.name,
                replica.outstanding,
                self.config.drain_timeout_s,
            )

    def _backing_off(self, replica: Replica[B], version: int) -> bool:
        failed = replica.failed_load
        return (
            failed is not None
            and failed[0] == version
            and asyncio.get_running_loop().time() < failed[1]
        )

    def _swap_lock(self) -> asyncio.Lock:
        """One swap of the set at a time (made on first use, inside the running loop)."""
        if self._swap_lock_ is None:
            self._swap_lock_ = asyncio.Lock()
        return self._swap_lock_

    async def _roll(
        self,
        source: WeightsSource,
        version: int,
        reload: Callable[[Replica[B]], Awaitable[None]],
    ) -> None:
        """`reload` each healthy replica behind `version`, one after another; raise after
        the roll if any failed (a replica backing off from this version counts as failed)."""
        self._target = (source, version)
        failed: list[str] = []
        for replica in list(self._replicas):
            if not replica.healthy or replica.backend.version >= version:
                continue
            if self._backing_off(replica, version) or not await self._load_one(
                replica, version, reload
            ):
                failed.append(replica.name)
        if failed:
            raise BackendError(f"replicas {failed} could not load version {version}")

    async def _load_one(
        self, replica: Replica[B], version: int, reload: Callable[[Replica[B]], Awaitable[None]]
    ) -> bool:
        try:
            await reload(replica)
        except Exception as exc:
            replica.last_error = f"load v{version}: {exc}"
            # Retrying at once would drain this replica on every swap pass.
            retry_at = asyncio.get_running_loop().time() + self.config.load_retry_s
            replica.failed_load = (version, retry_at)
            logger.warning("replica %s failed to load version %d: %s", replica.name, version, exc)
            if not await self._probe(replica):
                self._take_out(replica, replica.last_error)
            return False
        replica.failed_load = None
        return True

    async def _reload_routed(
        self, replica: Replica[B], source: WeightsSource, version: int, policy: SwapPolicy
    ) -> None:
        """`drain`: out of routing while its outstanding requests finish and it reloads, then
        back in (the last routable one drains and reloads in place, by its backend's own
        contract). `keep`: paused, routed to only when no other replica can take a request,
        while its backend reloads in place; its requests stay on it, paused by the reload,
        and go on with `version`."""
        async with replica.lock:
            others = any(r.routable for r in self._replicas if r is not replica)
            replica.loading = others and policy.mode == "drain"
            try:
                with replica.pausing(policy):
                    if replica.loading:
                        await self._drain(replica)
                    await replica.backend.load_weights(source, version, policy)
                logger.info("replica %s now serves version %d", replica.name, version)
            finally:
                replica.loading = False


def shared_policy(server: ServerClient, policy: SwapPolicy) -> SwapPolicy:
    """The policy a swap agreed with other clients of `server` applies to it: `policy`,
    but `drain` for a server that does not label each token with its weights version.

    In a shared `keep` swap the requests of the clients that did not reload go on
    through the reload; they can only be labelled exactly by the server itself (their
    client learns of the new version after the server resumed), so a server without
    labels (`HttpBackend.labels_tokens` False, e.g. SGLang) is drained instead.
    """
    if policy.mode == "keep" and not server.labels_tokens:
        return replace(policy, mode="drain")
    return policy


class ReplicaStream(Generic[B]):
    """A streaming generation that moves to another replica if its first one fails early.

    "Early" means before any token reached the consumer; after that, a failure
    ends the stream with the error (see the module docstring).
    """

    def __init__(self, replicas: ReplicaSet[B], request: GenerateRequest) -> None:
        self._set = replicas
        self._request = request
        self._tried: set[str] = set()
        self._last: BackendError | None = None
        self._delivered = 0
        self._cancelled = False
        self._started = False
        self._outcome: GenerateResult | BackendError | None = None
        self._replica: Replica[B] | None = None
        self._held = False
        self._inner: TokenStream = self._open()

    @property
    def replica(self) -> str | None:
        """The name of the replica currently serving this stream."""
        return self._replica.name if self._replica else None

    def _open(self) -> TokenStream:
        """Start on the best untried replica; a synchronous start failure tries the next."""
        while len(self._tried) < self._set.config.max_attempts:
            replica = self._set._pick(
                self._request.affinity, self._tried, self._last, self._request.adapter
            )
            self._tried.add(replica.name)
            try:
                inner = replica.backend.start_stream(self._request)
            except BackendError as exc:
                self._last = exc
                replica.last_error = str(exc)
                continue
            self._replica, self._held = replica, True
            replica.outstanding += 1
            replica.served += 1
            return inner
        assert self._last is not None
        raise self._last

    def _release(self) -> None:
        if self._held and self._replica is not None:
            self._replica.outstanding -= 1
            self._held = False

    async def tokens(self) -> AsyncIterator[tuple[int, float]]:
        self._started = True
        try:
            while True:
                try:
                    async for item in self._inner.tokens():
                        self._delivered += 1
                        yield item
                    self._outcome = await self._inner.result()
                    return
                except BackendError as exc:
                    self._release()
                    replica = self._replica
                    assert replica is not None
                    await self._set._on_failure(replica, exc)
                    if self._delivered or self._cancelled:
                        self._outcome = exc
                        raise
                    self._last = exc
                    logger.info(
                        "stream failed on %s before its first token; retrying", replica.name
                    )
                    try:
                        self._inner = self._open()
                    except BackendError as final:
                        self._outcome = final
                        raise
        finally:
            self._release()

    def cancel(self) -> None:
        self._cancelled = True
        self._inner.cancel()

    async def result(self) -> GenerateResult:
        if self._outcome is None:
            if not self._started:
                async for _ in self.tokens():
                    pass
            else:  # the consumer stopped iterating (a disconnect): settle the current attempt
                try:
                    self._outcome = await self._inner.result()
                except BackendError as exc:
                    self._outcome = exc
        if isinstance(self._outcome, BackendError):
            raise self._outcome
        assert self._outcome is not None
        return self._outcome
