"""Reward posts (the audit trail): replays by idempotency key and episode-level rewards."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from core.store.models import Reward


def latest_episode_reward_sync(session: Session, run_id: str, episode_id: str) -> float | None:
    """The newest episode-level reward post, if any (per-turn posts live on completions)."""
    value = session.execute(
        select(Reward.value)
        .where(
            Reward.run_id == run_id,
            Reward.episode_id == episode_id,
            Reward.completion_id.is_(None),
        )
        .order_by(Reward.id.desc())
        .limit(1)
    ).scalar_one_or_none()
    return None if value is None else float(value)


async def reward_by_idempotency_key(session: AsyncSession, run_id: str, key: str) -> Reward | None:
    stmt = select(Reward).where(Reward.run_id == run_id, Reward.idempotency_key == key)
    return (await session.execute(stmt)).scalar_one_or_none()
