"""The inference servers registered for a run: list and remove (adding is a plain insert)."""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from core.store.db import rowcount
from core.store.models import RunReplica


async def replica_urls(session: AsyncSession, run_id: str) -> list[str]:
    """The run's server base URLs, in the order they were registered."""
    stmt = select(RunReplica.url).where(RunReplica.run_id == run_id).order_by(RunReplica.created_at)
    return list((await session.execute(stmt)).scalars())


async def remove_replica(session: AsyncSession, run_id: str, url: str) -> bool:
    """Unregister a server; False if it was not registered."""
    stmt = delete(RunReplica).where(RunReplica.run_id == run_id, RunReplica.url == url)
    return rowcount(await session.execute(stmt)) == 1
