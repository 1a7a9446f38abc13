"""One inference backend and chat template per run, loaded lazily off the event loop.

The run's backend kind (`inference.registry`) decides: an in-process kind
(`local`: `LocalBackend`) is loaded from the weights directory; a remote kind
(`vllm`, `sglang`, ...) gets one backend per registered replica URL (table
`run_replicas`), wrapped in a `ReplicaSet` (routing, health, failover, rolling
hot swap: inference/replicas.py).

LoRA runs (`RunConfig.lora_rank`) on an in-process kind share ONE backend per
(kind, base model directory): the base is loaded once, each run is an
`AdapterView` on it that loads only its adapter, and the base is closed when
its last run is unloaded. A remote LoRA run's replica set must serve adapters
itself (`AdapterBackend`); its view then routes its requests to its adapter.

Pinned versions (evaluation calls with `X-Rlgate-Version`, `pinned`) are
servings of a kept older version beside the run's current one; they never
take part in swaps, since a pinned version never changes. A full-model run on
an in-process kind gets a whole extra copy of the model, at most
`eval_pinned_copies` per process (least recently used closed first); a LoRA
run gets the pinned version's adapter under a name of its own
(`pinned_adapter_name`) on the run's base (in-process) or on its servers
(remote), at most `MAX_PINNED_ADAPTERS` per process. A full-model run on
servers cannot pin: its servers hold one set of weights.

Closing an evicted pinned serving lets the calls already queued on it finish
(an in-process backend drains its queue; an adapter unload drains the
adapter's requests); a call that took the serving just before the eviction
and had not yet submitted fails like any call to a closed backend. Size
`eval_pinned_copies` to the versions compared at once to keep that rare.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from core.config import ReplicaConfig, ServerCredentials
from inference import registry
from inference.backend import AdapterBackend, Backend, BackendError
from inference.chat_template import ChatTemplate
from inference.lora_view import AdapterView
from inference.replicas import ReplicaSet
from inference.swap import InPlaceSwap, ServerClient, ServerSwaps, SoleServerSwaps, Swapper
from inference.weight_source import weights_source

logger = logging.getLogger(__name__)


@dataclass
class RunServing:
    """A loaded run: its backend, its template, and how the swap loop swaps it."""

    backend: Backend
    template: ChatTemplate
    max_context: int
    swapper: Swapper  # chosen when the run is loaded (`inference.swap`)
    replicas: ReplicaSet[ServerClient] | None = None  # a remote run's servers
    # The version a call on it must start on (`GenerateRequest.version`): set on the copy
    # that serves an evaluation call pinning the version being served, which a swap may
    # replace before the backend admits the call.
    start_on: int | None = None


@dataclass(frozen=True)
class ServedWeights:
    """Which weights a serving holds: `version` of the model at `model_dir` on a `backend`
    kind, read from `ckpt` (None: the model as it is at `model_dir`). `lora`: the run trains
    a LoRA adapter, and `ckpt` (beyond version 0) is that adapter."""

    model_dir: Path
    backend: str
    version: int
    ckpt: Path | None
    lora: bool = False


@dataclass
class SharedBase:
    """One base model served in-process to every LoRA run on it (their adapters ride on it)."""

    serving: RunServing
    runs: set[str]


class PinUnsupported(ValueError):
    """This run's backend cannot serve an older version beside its current one."""


# Pinned LoRA versions served at once by one gateway process, over all runs: an adapter is
# a few MB, but each one served on vLLM also competes for its --max-loras slots.
MAX_PINNED_ADAPTERS = 8


def pinned_adapter_name(run_id: str, version: int, tag: str = "") -> str:
    """The adapter name a pinned LoRA version is served under; never a run id (those
    contain no "@"), so it never replaces the run's own adapter. `tag`: this process's,
    for adapters on servers that other gateway processes also load pins onto."""
    return f"{run_id}@v{version}" + (f".{tag}" if tag else "")


def _parts(w: ServedWeights) -> tuple[Path, str, int, Path | None]:
    return w.model_dir, w.backend, w.version, w.ckpt


def _model_context(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 2048)


class BackendPool:
    """Owns every backend of this gateway. `get` loads the run's model on first use."""

    def __init__(
        self,
        max_batch_size: int = 64,
        sessions: async_sessionmaker[AsyncSession] | None = None,
        replica_config: ReplicaConfig | None = None,
        threads: int = 0,
        credentials: ServerCredentials | None = None,
        swaps: ServerSwaps | None = None,
        eval_pinned_copies: int = 1,
        kv_cache_mb: int = 4096,
        prefix_cache_mb: int = 512,
    ) -> None:
        """`swaps`: how a remote run's servers join this process's swaps (default: alone;
        on PostgreSQL, the barrier agreed with the other gateway processes).
        `eval_pinned_copies`: extra full model copies pinned versions may hold (`pinned`).
        `kv_cache_mb`, `prefix_cache_mb`: each in-process backend's KV caps (MiB)."""
        if eval_pinned_copies < 0:
            raise ValueError("eval_pinned_copies must be 0 or more")
        self.max_batch_size = max_batch_size
        self.credentials = credentials  # what remote runs' servers and weight server require
        self.threads = threads  # torch threads of an in-process backend (0: torch's default)
        self.kv_cache_bytes, self.prefix_cache_bytes = kv_cache_mb << 20, prefix_cache_mb << 20
        self.sessions = sessions  # needed for remote runs (their replica URLs)
        self.replica_config = replica_config or ReplicaConfig()
        self._serving: dict[str, RunServing] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._bases: dict[tuple[str, Path], SharedBase] = {}  # (kind, base dir) -> LoRA base
        self.swaps: ServerSwaps = swaps or SoleServerSwaps()
        self.eval_pinned_copies = eval_pinned_copies
        # (run, version) -> pinned serving, least recently used first
        self._pinned_copies: OrderedDict[tuple[str, int], RunServing] = OrderedDict()
        self._pinned_adapters: OrderedDict[tuple[str, int], RunServing] = OrderedDict()
        self._pin_locks: dict[int, asyncio.Lock] = {}  # one load at a time per pin cache
        self._pin_tag = uuid.uuid4().hex[:8]  # this process's pinned adapters on servers

    def loaded(self) -> dict[str, RunServing]:
        return dict(self._serving)

    def serving_version(self, run_id: str) -> int | None:
        """The policy version the run's backend serves now; None: not loaded here."""
        serving = self._serving.get(run_id)
        return None if serving is None else serving.backend.version

    async def get(self, run_id: str, weights: ServedWeights) -> RunServing:
        """The run's serving, loaded with `weights` on first use."""
        model_dir, backend, version, ckpt = _parts(weights)
        self._check_kind(backend)
        if run_id in self._serving:
            return self._serving[run_id]
        lock = self._locks.setdefault(run_id, asyncio.Lock())
        async with lock:
            if run_id not in self._serving:
                if registry.get(backend).remote and weights.lora:
                    # the servers as they are (the base); the run's view loads its adapter
                    serving = await self._load_remote(run_id, model_dir, backend, 0, None)
                    serving = await self._adapter_view(run_id, serving, version, ckpt)
                elif registry.get(backend).remote:
                    serving = await self._load_remote(run_id, model_dir, backend, version, ckpt)
                elif weights.lora:
                    serving = await self._load_lora(run_id, model_dir, backend, version, ckpt)
                else:
                    serving = await asyncio.to_thread(self._load, model_dir, backend, version, ckpt)
                self._serving[run_id] = serving
        return self._serving[run_id]

    async def pinned(self, run_id: str, weights: ServedWeights) -> RunServing:
        """A serving of the run's kept `weights.version` beside its current one, for
        evaluation calls that pin it (`X-Rlgate-Version`); it never takes part in the run's
        swaps, and its results report that version.

        Raises `PinUnsupported` where it cannot be served (a full-model run on servers, or
        no pinned copies allowed), `OSError` where loading it failed.
        """
        model_dir, backend, version, ckpt = _parts(weights)
        self._check_kind(backend)
        key = (run_id, version)
        if weights.lora:
            load = partial(self._load_pinned_adapter, run_id, model_dir, backend, version, ckpt)
            return await self._pinned(self._pinned_adapters, MAX_PINNED_ADAPTERS, key, load)
        if registry.get(backend).remote:
            raise PinUnsupported(
                f"run {run_id} samples from {backend} servers, which hold only its current weights"
            )
        if self.eval_pinned_copies < 1:
            raise PinUnsupported(
                "this gateway holds no extra model copies for pins (eval_pinned_copies is 0)"
            )
        load = partial(asyncio.to_thread, self._load, model_dir, backend, version, ckpt)
        return await self._pinned(self._pinned_copies, self.eval_pinned_copies, key, load)

    async def _pinned(
        self,
        cache: OrderedDict[tuple[str, int], RunServing],
        bound: int,
        key: tuple[str, int],
        load: Callable[[], Awaitable[RunServing]],
    ) -> RunServing:
        """`cache[key]`, loaded by `load` when missing after the least recently used
        servings past `bound - 1` are released (so at most `bound` are held, loads
        included: one load at a time per cache)."""
        serving = cache.get(key)
        if serving is None:
            async with self._pin_locks.setdefault(id(cache), asyncio.Lock()):
                serving = cache.get(key)
                if serving is None:
                    while len(cache) >= bound:
                        (run_id, version), old = cache.popitem(last=False)
                        logger.info("run %s: pinned v%d released (least recently used)",
                                    run_id, version)  # fmt: skip
                        await self._release_pinned(run_id, version, old)
                    try:
                        serving = await load()
                    except BackendError as exc:
                        raise OSError(str(exc)) from exc
                    cache[key] = serving
                    logger.info("run %s: v%d pinned for evaluation calls", *key)
        cache.move_to_end(key)
        return serving

    async def _load_pinned_adapter(
        self, run_id: str, model_dir: Path, backend: str, version: int, ckpt: Path | None
    ) -> RunServing:
        """Version `version` of a LoRA run as an adapter of its own (version 0: the base, no
        adapter): on the shared base in-process, on the run's servers for a remote run."""
        if not registry.get(backend).remote:
            name = pinned_adapter_name(run_id, version)
            return await self._load_lora(name, model_dir, backend, version, ckpt, pinned=True)
        run = self._serving.get(run_id) or await self._load_current(run_id, model_dir, backend)
        if run.replicas is None:
            raise OSError(f"run {run_id} has no servers loaded to pin a version on")
        name = pinned_adapter_name(run_id, version, self._pin_tag)
        # a pin whose adapter is gone (no replica has it) fails; never the base's answer
        view = AdapterView(run.replicas, name, base_until_loaded=version == 0)
        if version > 0 and ckpt is not None:
            if not ckpt.is_dir():
                raise OSError(f"adapter {ckpt} of version {version} is missing")
            try:
                await view.load_weights(ckpt, version)
            except BaseException:  # replicas that did load it, or get it when back: drop it
                with contextlib.suppress(Exception):
                    await run.replicas.unload_adapter(name)
                raise
        return RunServing(view, run.template, run.max_context, InPlaceSwap(view), run.replicas)

    async def _load_current(self, run_id: str, model_dir: Path, backend: str) -> RunServing:
        """The remote LoRA run's own serving, at its current version (its pins ride on its
        servers)."""
        from core.store.models import Run
        from core.store.runs import checkpoint_of

        if self.sessions is None:
            raise OSError(f"run {run_id}: no store to find its servers in")
        async with self.sessions() as s:
            run = await s.get(Run, run_id)
            if run is None:
                raise OSError(f"no run {run_id}")
            version = run.current_version
            ckpt = await checkpoint_of(s, run_id, version)
        try:
            weights = ServedWeights(model_dir, backend, version, Path(ckpt) if ckpt else None, True)
            return await self.get(run_id, weights)
        except ValueError as exc:  # no replica registered: the run cannot serve at all
            raise OSError(str(exc)) from exc

    async def _release_pinned(self, run_id: str, version: int, serving: RunServing) -> None:
        """Close one pinned serving: a copy's backend, or a pinned adapter (and its hold on
        the shared base, in-process)."""
        try:
            await serving.backend.close()
        except Exception:  # a server already gone: nothing left to unload there
            logger.warning("run %s: releasing pinned v%d failed", run_id, version, exc_info=True)
        finally:
            await self._release_base(pinned_adapter_name(run_id, version))

    async def _release_pins(self, run_id: str | None) -> None:
        """Release the pinned servings of `run_id` (None: of every run)."""
        for cache in (self._pinned_adapters, self._pinned_copies):
            for key in [k for k in cache if run_id is None or k[0] == run_id]:
                serving = cache.pop(key, None)
                if serving is not None:
                    await self._release_pinned(*key, serving)

    def pinned_versions(self) -> dict[str, list[int]]:
        """Run id -> the pinned versions this process serves now (copies and adapters)."""
        found: dict[str, list[int]] = {}
        for run_id, version in [*self._pinned_copies, *self._pinned_adapters]:
            found.setdefault(run_id, []).append(version)
        return {run_id: sorted(v) for run_id, v in found.items()}

    def _check_kind(self, backend: str) -> None:
        """Raise if this pool may not serve runs of kind `backend` (any kind here)."""

    async def _load_lora(
        self,
        run_id: str,
        model_dir: Path,
        backend: str,
        version: int,
        ckpt: Path | None,
        *,
        pinned: bool = False,
    ) -> RunServing:
        """The run's view on the shared base of (`backend`, `model_dir`), loaded if first.
        `pinned`: a pinned version's view (`run_id` is its adapter name), see `_adapter_view`."""
        key = (backend, model_dir.resolve())
        async with self._locks.setdefault(f"base:{key}", asyncio.Lock()):
            base = self._bases.get(key)
            if base is None:
                serving = await asyncio.to_thread(self._load, model_dir, backend, 0, None)
                if not isinstance(serving.backend, AdapterBackend):
                    await serving.backend.close()
                    raise ValueError(f"the {backend} backend cannot serve LoRA adapters")
                base = self._bases[key] = SharedBase(serving, set())
            base.runs.add(run_id)
        try:
            return await self._adapter_view(
                run_id, base.serving, version, ckpt, shared=True, pinned=pinned
            )
        except BaseException:
            await self._release_base(run_id)
            raise

    async def _adapter_view(
        self,
        run_id: str,
        serving: RunServing,
        version: int,
        ckpt: Path | None,
        *,
        shared: bool = False,
        pinned: bool = False,
    ) -> RunServing:
        """`serving` seen by one LoRA run: its adapter (version > 0) loaded, its requests
        routed to it. `pinned`: a pinned version's, whose requests fail rather than sample
        the base model once its adapter is unloaded (released while a call held it)."""
        if not isinstance(serving.backend, AdapterBackend):
            await serving.backend.close()
            raise ValueError(f"run {run_id}: its backend cannot serve LoRA adapters")
        view = AdapterView(
            serving.backend,
            run_id,
            owns_backend=not shared,
            base_until_loaded=not pinned or version == 0,
        )
        if version > 0 and ckpt is not None:
            if not ckpt.is_dir():
                raise OSError(f"adapter {ckpt} of version {version} is missing")
            await view.load_weights(ckpt, version)
        # the adapter swaps in this process alone; closing leaves the servers' swaps too
        swapper = InPlaceSwap(view, serving.swapper.close)
        return RunServing(view, serving.template, serving.max_context, swapper, serving.replicas)

    async def _release_base(self, run_id: str) -> None:
        """Drop `run_id` from its shared base; the last run out closes the base."""
        for key, base in list(self._bases.items()):
            if run_id not in base.runs:
                continue
            async with self._locks.setdefault(f"base:{key}", asyncio.Lock()):
                base.runs.discard(run_id)
                if not base.runs and self._bases.get(key) is base:
                    del self._bases[key]
                    await base.serving.backend.close()
                    logger.info("closed the shared base %s (no LoRA run left on it)", key[1])

    def shared_bases(self) -> dict[Path, set[str]]:
        """Base model directory -> the LoRA runs it serves now."""
        return {key[1]: set(b.runs) for key, b in self._bases.items()}

    def _load(self, model_dir: Path, backend: str, version: int, ckpt: Path | None) -> RunServing:
        # Serve the newest checkpoint directly, so a restarted gateway resumes at its version.
        source = ckpt if ckpt is not None else model_dir
        if not source.is_dir():
            raise OSError(f"checkpoint {source} of version {version} is missing")
        template = ChatTemplate(model_dir)
        be = registry.get(backend).load_local(
            source,
            version,
            max_batch_size=self.max_batch_size,
            decode=template.decode,
            threads=self.threads,
            kv_cache_bytes=self.kv_cache_bytes,
            prefix_cache_bytes=self.prefix_cache_bytes,
        )
        logger.info("loaded %s (version %d) for serving", source, version)
        return RunServing(be, template, be.max_context, InPlaceSwap(be))

    async def replica_urls(self, run_id: str) -> list[str]:
        from core.store.replicas import replica_urls

        if self.sessions is None:
            return []
        async with self.sessions() as s:
            return await replica_urls(s, run_id)

    async def _load_remote(
        self, run_id: str, model_dir: Path, backend: str, version: int, ckpt: Path | None
    ) -> RunServing:
        """A ReplicaSet over the run's servers, brought to `version` before it serves.

        A server registered with a run is assumed to serve the run's base model
        (version 0); if the run is further along, the set loads `ckpt` first.
        """
        urls = await self.replica_urls(run_id)
        if not urls:
            raise ValueError(
                f"run {run_id} has no {backend} replica: register one with "
                f"POST /admin/v1/runs/{run_id}/replicas or `rlgate inference serve --run`"
            )
        template = await asyncio.to_thread(ChatTemplate, model_dir)
        max_context = await asyncio.to_thread(_model_context, model_dir)
        kind = registry.get(backend)
        members = [(url, kind.connect_to(url, credentials=self.credentials), url) for url in urls]
        replicas = ReplicaSet(members, self.replica_config)
        try:
            max_context = min(max_context, await _served_context(members) or max_context)
            # from the trainer, if it offers the version
            source = weights_source(ckpt, version) if version > 0 and ckpt is not None else None
            swapper = await self.swaps.join(run_id, replicas, source, version)
        except BaseException:
            await replicas.close()
            raise
        replicas.start()
        logger.info("run %s: %d %s replica(s) at v%d", run_id, len(urls), backend, version)
        return RunServing(replicas, template, max_context, swapper, replicas)

    def _replica_set(self, run_id: str) -> ReplicaSet[ServerClient] | None:
        """The loaded run's replica set, also behind a remote LoRA run's adapter view."""
        serving = self._serving.get(run_id)
        return None if serving is None else serving.replicas

    async def add_replica(self, run_id: str, kind: str, url: str) -> None:
        """Put a newly registered server into a loaded run's set (it loads the set's weights).

        Called after the registration is stored. Under the run's load lock: a load that
        read the run's servers before the registration finishes first, and the server
        then joins the set it made (without the lock it was left out until a reload).
        """
        async with self._locks.setdefault(run_id, asyncio.Lock()):
            replicas = self._replica_set(run_id)
            if replicas is not None and url not in replicas.versions():
                backend = registry.get(kind).connect_to(url, credentials=self.credentials)
                await replicas.add_replica(url, backend, url)

    async def remove_replica(self, run_id: str, url: str) -> None:
        """Drain and drop a server from a loaded run; the last one unloads the run.

        Called after the removal is stored, under the run's load lock, as `add_replica`:
        a load that read the server before its removal must not keep it (it did, and
        served it on until the gateway restarted).
        """
        async with self._locks.setdefault(run_id, asyncio.Lock()):
            replicas = self._replica_set(run_id)
            if replicas is None or url not in (names := replicas.versions()):
                return
            if len(names) == 1:
                await self.unload(run_id)
            else:
                await replicas.remove_replica(url)

    def backend_threads(self) -> dict[str, int]:
        """Run id -> torch threads its in-process backend samples on (remote runs: absent)."""
        found = {}
        for run_id, serving in self._serving.items():
            n = getattr(serving.backend, "torch_threads", None)
            if n is not None:
                found[run_id] = int(n)
        return found

    def replica_status(self, run_id: str) -> list[dict] | None:
        """Per replica: name, url, healthy, loading, version, outstanding... (None: not loaded)."""
        replicas = self._replica_set(run_id)
        return None if replicas is None else replicas.replica_status()

    async def unload(self, run_id: str) -> None:
        """Stop serving the run and its pinned versions; a LoRA run unloads only its adapters
        from the shared base or its servers."""
        await self._release_pins(run_id)  # before the servers they ride on close
        serving = self._serving.pop(run_id, None)
        try:
            if serving is not None:
                await serving.backend.close()
        finally:
            await self._release_base(run_id)
            if serving is not None:
                await serving.swapper.close()

    async def close(self) -> None:
        await self._release_pins(None)
        for run_id in list(self._serving):
            await self.unload(run_id)
        await self.swaps.close()


async def _served_context(members: list[tuple[str, ServerClient, str]]) -> int | None:
    """The first answering server's own context limit (vLLM --max-model-len), if any."""
    for _, be, _ in members:
        try:
            return await be.served_context()
        except Exception as exc:  # a down replica: ask the next one
            logger.warning("%s: %s", be, exc)
    return None
