"""Agent key -> run lookups, cached for a moment: the one database read every agent call made.

Consistency contract:

* A write through this process's admin API or dashboard (revoke, rotate,
  pause, stop, update, delete, ...) empties the cache before its response
  starts, so the caller's next request sees the change: "revoked at once"
  holds for every change made through this gateway.
* A lookup that began before such a write is not cached (its generation is
  old), so a read racing the write cannot put the old state back.
* A change made elsewhere (another gateway process, the trainer marking a
  run failed) is seen within `ttl_s`. `ttl_s = 0` turns the cache off.

Only successful lookups are cached: an unknown key always reaches the
database, so guessing keys cannot fill memory.
"""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.store.models import Run

_READS = frozenset({"GET", "HEAD", "OPTIONS"})
_ADMIN_PATHS = ("/admin/", "/dashboard")


class RunKeyCache:
    def __init__(self, ttl_s: float = 1.0, max_entries: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.generation = 0
        self._entries: dict[str, tuple[Run, float]] = {}

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

    def invalidate(self) -> None:
        self.generation += 1
        self._entries.clear()


class InvalidateOnAdminWrite:
    """ASGI middleware: an admin or dashboard write empties the cache before and after it runs.

    "After" is the moment its response starts, i.e. after the handler's commit
    and before the client can send its next request.
    """

    def __init__(self, app: ASGIApp, cache: RunKeyCache) -> None:
        self.app = app
        self.cache = cache

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] in _READS
            or not scope["path"].startswith(_ADMIN_PATHS)
        ):
            await self.app(scope, receive, send)
            return
        self.cache.invalidate()

        async def send_after_write(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.cache.invalidate()
            await send(message)

        await self.app(scope, receive, send_after_write)
