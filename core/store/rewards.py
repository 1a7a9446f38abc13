"""Reward posts (the audit trail): replays by idempotency key and episode-level rewards."""

from __future__ import annotations

from sqlalchemy import ColumnElement, and_, or_, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from core.store.models import Reward, Run


def episode_posts_of(run: Run | None, run_id: str) -> ColumnElement[bool]:
    """Which episode-level reward posts are run `run_id`'s: its own, or, for a policy's run
    (`Run.parent_id`), those made to its parent for the whole episode or scoped to this
    policy (docs/policies.md)."""
    whole = Reward.completion_id.is_(None)
    if run is None or run.parent_id is None:
        return and_(Reward.run_id == run_id, whole)
    mine = or_(Reward.policy.is_(None), Reward.policy == run.policy)
    return and_(Reward.run_id == run.parent_id, whole, mine)


def latest_episode_reward_sync(session: Session, run_id: str, episode_id: str) -> float | None:
    """The newest episode-level reward post, if any (per-turn posts live on completions)."""
    stmt = select(Reward.value).where(
        episode_posts_of(session.get(Run, run_id), run_id), Reward.episode_id == episode_id
    )
    value = session.execute(stmt.order_by(Reward.id.desc()).limit(1)).scalar_one_or_none()
    return None if value is None else float(value)


async def reward_by_idempotency_key(session: AsyncSession, run_id: str, key: str) -> Reward | None:
    stmt = select(Reward).where(Reward.run_id == run_id, Reward.idempotency_key == key)
    return (await session.execute(stmt)).scalar_one_or_none()
