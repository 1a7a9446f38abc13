"""Trainer workers and queue status: Celery inspect with a short timeout, off the event loop."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from celery import Celery
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from core.settings import ThreadBudget
from core.store.steps import pending_steps
from gateway.control.backends import BackendPool
from gateway.protocol_admin import ThreadsStatus, WorkersStatus

logger = logging.getLogger(__name__)


def _inspect(celery: Celery, method: str, timeout_s: float) -> dict[str, Any]:
    """One broadcast (`active` or `reserved`): worker name -> task list; {} if none answered."""
    return getattr(celery.control.inspect(timeout=timeout_s), method)() or {}


def _task(t: dict[str, Any]) -> dict[str, Any]:
    return {"id": t.get("id"), "name": t.get("name"), "args": t.get("args")}


def _queue_depth(celery: Celery, queue: str) -> int | None:
    """Messages waiting in the broker's queue; None when the transport cannot say."""
    with celery.connection_for_read() as conn:
        try:
            _name, count, _consumers = conn.default_channel.queue_declare(queue, passive=True)
        except Exception:  # filesystem transport and others without passive declare
            return None
        return int(count)


class WorkerAdmin:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        celery: Celery,
        queue: str,
        timeout_s: float = 1.0,
        pool: BackendPool | None = None,
        threads: ThreadBudget | None = None,
    ) -> None:
        self.sessions = sessions
        self.celery = celery
        self.queue = queue
        self.timeout_s = timeout_s
        self.pool = pool
        self.threads = threads

    def threads_status(self) -> ThreadsStatus | None:
        if self.threads is None:
            return None
        return ThreadsStatus(
            cores=self.threads.cores,
            backend_threads=self.threads.backend,
            trainer_threads=self.threads.trainer,
            backends=self.pool.backend_threads() if self.pool is not None else {},
        )

    async def status(self) -> WorkersStatus:
        async with self.sessions() as s:
            pending = await pending_steps(s)
        broker = self.celery.conf.broker_url.split("://", 1)[0]
        workers: dict[str, Any] = {}
        depth: int | None = None
        error = None
        try:
            # Both broadcasts at once: each waits out the full timeout for late workers.
            active, reserved, depth = await asyncio.wait_for(
                asyncio.gather(
                    asyncio.to_thread(_inspect, self.celery, "active", self.timeout_s),
                    asyncio.to_thread(_inspect, self.celery, "reserved", self.timeout_s),
                    asyncio.to_thread(_queue_depth, self.celery, self.queue),
                ),
                self.timeout_s * 5,
            )
            workers = {
                name: {
                    "active": [_task(t) for t in active.get(name, [])],
                    "reserved": [_task(t) for t in reserved.get(name, [])],
                }
                for name in sorted(set(active) | set(reserved))
            }
        except Exception as exc:  # a broker that is down must not fail the admin page
            logger.warning("celery inspect failed: %s", exc)
            error = f"{type(exc).__name__}: {exc}"[:300]
        return WorkersStatus(
            broker=broker,
            workers=workers,
            reachable=error is None,
            queue=self.queue,
            queue_depth=depth,
            pending_steps=int(pending),
            error=error,
            threads=self.threads_status(),
        )
