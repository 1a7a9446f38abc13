"""Data access for agent keys: small async functions over an AsyncSession."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from core.store.models import ApiKey, Run


async def key_in_run(session: AsyncSession, run_id: str, key_id: int) -> ApiKey | None:
    """Key `key_id` if it belongs to run `run_id` (revoked or not), else None."""
    row = await session.get(ApiKey, key_id)
    return row if row is not None and row.run_id == run_id else None


async def run_for_key_hash(session: AsyncSession, key_hash: str) -> Run | None:
    """The run of a key that is not revoked."""
    stmt = (
        select(Run)
        .join(ApiKey, ApiKey.run_id == Run.id)
        .where(ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None))
    )
    return (await session.execute(stmt)).scalar_one_or_none()


async def run_keys(session: AsyncSession, run_id: str) -> list[ApiKey]:
    """Every key of the run, revoked ones included, oldest first."""
    stmt = select(ApiKey).where(ApiKey.run_id == run_id).order_by(ApiKey.id)
    return list((await session.execute(stmt)).scalars())
