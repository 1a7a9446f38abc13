"""The inference servers of a run: register, list with live state, remove."""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from core.store.models import Run, RunReplica
from core.store.replicas import remove_replica, replica_urls
from gateway.control.backends import BackendPool
from gateway.errors import Conflict, InvalidRequest, NotFound
from gateway.protocol import ReplicaPublic
from inference import registry

logger = logging.getLogger(__name__)


def normalize_url(url: str, param: str = "url") -> str:
    """`http(s)://host:port[/path]` without a trailing slash or `/v1`; else InvalidRequest."""
    url = url.strip()
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        raise InvalidRequest("a base URL has no spaces or control characters", param=param)
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # e.g. an unbalanced IPv6 bracket
        raise InvalidRequest(f"{url!r} is not a URL: {exc}", param=param) from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidRequest(f"{url!r} is not an http(s):// base URL", param=param)
    if parts.query or parts.fragment:
        raise InvalidRequest(f"{url!r}: a base URL has no query or fragment", param=param)
    try:
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError as exc:
        raise InvalidRequest(f"{url!r}: {exc}", param=param) from exc
    path = parts.path.rstrip("/").removesuffix("/v1")
    return f"{parts.scheme}://{parts.netloc}{path}"


class ReplicaService:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], pool: BackendPool) -> None:
        self.sessions = sessions
        self.pool = pool

    async def _remote_run(self, s: AsyncSession, run_id: str) -> Run:
        run = await s.get(Run, run_id)
        if run is None:
            raise NotFound(f"no run {run_id!r}", param="run_id")
        if run.backend not in registry.remote_names():
            raise InvalidRequest(
                f"run {run_id} uses the {run.backend} backend, which has no replicas",
                param="run_id",
            )
        return run

    async def add(self, run_id: str, url: str) -> list[ReplicaPublic]:
        url = normalize_url(url)
        try:
            async with self.sessions.begin() as s:
                run = await self._remote_run(s, run_id)
                kind = run.backend
                s.add(RunReplica(run_id=run_id, url=url))
        except IntegrityError as exc:
            raise Conflict(f"{url} is already a replica of run {run_id}", param="url") from exc
        await self.pool.add_replica(run_id, kind, url)
        logger.info("run %s: replica %s registered", run_id, url)
        return await self.list(run_id)

    async def remove(self, run_id: str, url: str) -> list[ReplicaPublic]:
        url = normalize_url(url)
        async with self.sessions.begin() as s:
            await self._remote_run(s, run_id)
            if not await remove_replica(s, run_id, url):
                raise NotFound(f"{url} is not a replica of run {run_id}", param="url")
        await self.pool.remove_replica(run_id, url)
        logger.info("run %s: replica %s removed", run_id, url)
        return await self.list(run_id)

    async def list(self, run_id: str) -> list[ReplicaPublic]:
        async with self.sessions() as s:
            if await s.get(Run, run_id) is None:
                raise NotFound(f"no run {run_id!r}", param="run_id")
            urls = await replica_urls(s, run_id)
        return public_replicas(urls, self.pool.replica_status(run_id))


def public_replicas(urls: list[str], live: list[dict] | None) -> list[ReplicaPublic]:
    """Registered URLs joined with the live state of a loaded run (by replica name = URL)."""
    by_name = {r["name"]: r for r in live or []}
    out = []
    for url in urls:
        state = by_name.get(url, {})
        out.append(
            ReplicaPublic(
                url=url,
                **{k: state.get(k) for k in ReplicaPublic.model_fields if k != "url"},
            )
        )
    return out
