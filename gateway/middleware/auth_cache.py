"""Agent key -> run lookups, cached for a moment: the one database read every agent call made.

Consistency contract:

* A write through this process's admin API or dashboard (revoke, rotate,
  pause, stop, update, delete, ...) empties the cache when its response
  starts, after the handler's commit and before the client can send its next
  request, so the caller's next request sees the change: "revoked at once"
  holds for every change made through this gateway.
* A lookup that began before that moment is not cached (its generation is
  old), so a read racing the write cannot put the old state back.
* Only a write that succeeded (status below 400) and carried an admin
  credential (the admin key, or a dashboard session) empties the cache: a
  stranger's `POST /admin/...` costs the agents nothing.
* A change made elsewhere (another gateway process, the trainer marking a
  run failed) is seen within `ttl_s`. `ttl_s = 0` turns the cache off.

Only successful lookups are cached: an unknown key always reaches the
database, so guessing keys cannot fill memory; at most `max_lookups` such
reads run at once (the rest wait their turn), so a flood of wrong keys
cannot take the database pool from the rest of the gateway.

Concurrent misses for one key share one lookup (when the entry expires
under load, every agent of the run would otherwise read the database at
once). A caller that arrives after an invalidation never joins a lookup
that started before it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.store.models import Run
from gateway.dashboard.auth import current_session
from gateway.keys import admin_key_matches
from gateway.middleware.identity import identity_of

_READS = frozenset({"GET", "HEAD", "OPTIONS"})
_ADMIN_PATHS = ("/admin/", "/dashboard")


class RunKeyCache:
    def __init__(self, ttl_s: float = 1.0, max_entries: int = 10_000, max_lookups: int = 4) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.generation = 0
        self.lookups = 0  # store reads made (a figure for the tests)
        self._lookup_slots = asyncio.Semaphore(max_lookups)
        self._entries: dict[str, tuple[Run, float]] = {}
        self._lookups: dict[str, asyncio.Future[Run | None]] = {}
        # Other caches of run state, emptied with this one (`gateway.agent.policies`).
        self.listeners: list[Callable[[], None]] = []

    def get(self, key_hash: str) -> Run | None:
        entry = self._entries.get(key_hash)
        if entry is None:
            return None
        run, expires = entry
        if time.monotonic() >= expires:
            self._entries.pop(key_hash, None)
            return None
        return run

    def put(self, key_hash: str, run: Run, generation: int) -> None:
        """Cache `run` if no invalidation happened since `generation` was read."""
        if self.ttl_s <= 0 or generation != self.generation:
            return
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        self._entries[key_hash] = (run, time.monotonic() + self.ttl_s)

    async def get_or_load(
        self, key_hash: str, load: Callable[[], Awaitable[Run | None]]
    ) -> Run | None:
        """The cached run, else `load()`'s, shared with every concurrent miss of the key."""
        run = self.get(key_hash)
        if run is not None:
            return run
        lookup = self._lookups.get(key_hash)
        if lookup is None:
            lookup = asyncio.ensure_future(self._bounded(load))
            self._lookups[key_hash] = lookup
            lookup.add_done_callback(self._landed(key_hash, self.generation))
        # shielded: one caller going away does not cancel the others' lookup
        return await asyncio.shield(lookup)

    async def _bounded(self, load: Callable[[], Awaitable[Run | None]]) -> Run | None:
        async with self._lookup_slots:
            self.lookups += 1
            return await load()

    def _landed(self, key_hash: str, generation: int) -> Callable[[asyncio.Future], None]:
        def done(lookup: asyncio.Future[Run | None]) -> None:
            if self._lookups.get(key_hash) is lookup:
                del self._lookups[key_hash]
            if not lookup.cancelled() and lookup.exception() is None:
                run = lookup.result()
                if run is not None:
                    self.put(key_hash, run, generation)

        return done

    def invalidate(self) -> None:
        self.generation += 1
        self._entries.clear()
        self._lookups.clear()  # lookups in flight read the old state: nobody new joins them
        for listener in self.listeners:
            listener()


class InvalidateOnAdminWrite:
    """ASGI middleware: an admin or dashboard write empties the cache as its response starts,
    if it succeeded and carried an admin credential (see the module docstring)."""

    def __init__(self, app: ASGIApp, cache: RunKeyCache) -> None:
        self.app = app
        self.cache = cache

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] in _READS
            or not scope["path"].startswith(_ADMIN_PATHS)
            or not _credentialed(scope)
        ):
            await self.app(scope, receive, send)
            return

        async def send_after_write(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] < 400:
                self.cache.invalidate()
            await send(message)

        await self.app(scope, receive, send_after_write)


def _credentialed(scope: Scope) -> bool:
    """Whether the request carries the admin key or a dashboard session (checked again,
    with the peer, by the route; this only decides whether its write may empty the cache)."""
    state = scope["app"].state
    key = identity_of(scope).key
    if key is not None and admin_key_matches(key, state.admin_key):
        return True
    return current_session(Request(scope)) is not None
