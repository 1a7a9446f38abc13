"""Evaluation episodes past their run's retention, deleted with what hangs off them.

Each run keeps its newest `RunConfig.eval_keep_episodes` evaluation episodes
(newest by first call) and, with `eval_retention_s`, only those active within
that many seconds. An episode over either limit is deleted with its
completions, the stored responses that point at those completions and its
reward posts, in one transaction per chunk, so the held-out figures never
count half an episode. Training episodes are never selected: every query
here filters on `EpisodeStatus.EVAL`, which an episode holds for life.

An episode is only deleted once quiet (no call and no reward post) for
`QUIET_S` at least, whichever limit it is over: a conversation still going
on is never cut under the agent's feet, at the cost of keeping more than
`eval_keep_episodes` while more than that many start within `QUIET_S`.

The leader runs it (`gateway.control.scheduler`, at most every `INTERVAL_S`);
a pass deletes at most `CHUNK` episodes per transaction and goes on until
nothing is over, so a run that lowers its limit is caught up in one pass
without holding locks for long.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime, timedelta

from sqlalchemy import ColumnElement, delete, exists, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from core.store.models import Completion, Episode, Reward, Run
from core.store.responses import StoredResponse
from core.store.status import EpisodeStatus
from trainer.config import RunConfig

logger = logging.getLogger(__name__)

INTERVAL_S = 60.0  # between two passes of the leader
QUIET_S = 300.0  # an episode with a call or a reward this recent is never deleted
CHUNK = 500  # episodes deleted per transaction


def _quiet_since(run_id: str, cutoff: datetime) -> ColumnElement[bool]:
    """Evaluation episodes of `run_id` with neither a call nor a reward post since `cutoff`."""
    recent_call = exists().where(
        Completion.run_id == Episode.run_id,
        Completion.episode_id == Episode.id,
        Completion.created_at >= cutoff,
    )
    recent_reward = exists().where(
        Reward.run_id == Episode.run_id,
        Reward.episode_id == Episode.id,
        Reward.created_at >= cutoff,
    )
    return (
        (Episode.run_id == run_id)
        & (Episode.status == EpisodeStatus.EVAL)
        & (Episode.created_at < cutoff)
        & ~recent_call
        & ~recent_reward
    )


async def over_retention(
    s: AsyncSession, run_id: str, cfg: RunConfig, now: datetime, limit: int = CHUNK
) -> list[str]:
    """Up to `limit` ids of the run's evaluation episodes over its retention, oldest first."""
    quiet = _quiet_since(run_id, now - timedelta(seconds=QUIET_S))
    ids: list[str] = []
    if cfg.eval_retention_s is not None:
        age_s = max(cfg.eval_retention_s, QUIET_S)
        aged = _quiet_since(run_id, now - timedelta(seconds=age_s))
        stmt = select(Episode.id).where(aged).order_by(Episode.created_at, Episode.id)
        ids = list((await s.execute(stmt.limit(limit))).scalars())
    if len(ids) < limit:
        count = select(func.count()).where(
            Episode.run_id == run_id, Episode.status == EpisodeStatus.EVAL
        )
        excess = (await s.execute(count)).scalar_one() - cfg.eval_keep_episodes
        if excess > 0:
            # the newest `eval_keep_episodes` are kept: candidates are the oldest `excess`
            oldest = (
                select(Episode.id)
                .where(Episode.run_id == run_id, Episode.status == EpisodeStatus.EVAL)
                .order_by(Episode.created_at, Episode.id)
                .limit(excess)
                .subquery()
            )
            stmt = (
                select(Episode.id)
                .where(quiet, Episode.id.in_(select(oldest.c.id)))
                .order_by(Episode.created_at, Episode.id)
                .limit(limit)
            )
            seen = set(ids)
            ids += [i for i in (await s.execute(stmt)).scalars() if i not in seen]
    return ids[:limit]


async def delete_eval_episodes(s: AsyncSession, run_id: str, ids: list[str]) -> int:
    """Delete evaluation episodes `ids` of the run with their completions, responses and
    reward posts; returns how many episodes went. An id that is not an evaluation
    episode (any more) is left alone."""
    ids = list(
        (
            await s.execute(
                select(Episode.id).where(
                    Episode.run_id == run_id,
                    Episode.status == EpisodeStatus.EVAL,
                    Episode.id.in_(ids),
                )
            )
        ).scalars()
    )
    if not ids:
        return 0
    completions = select(Completion.id).where(
        Completion.run_id == run_id, Completion.episode_id.in_(ids)
    )
    await s.execute(
        delete(StoredResponse).where(
            StoredResponse.run_id == run_id, StoredResponse.completion_id.in_(completions)
        )
    )
    await s.execute(
        delete(Reward).where(
            Reward.run_id == run_id,
            or_(Reward.episode_id.in_(ids), Reward.completion_id.in_(completions)),
        )
    )
    await s.execute(
        delete(Completion).where(Completion.run_id == run_id, Completion.episode_id.in_(ids))
    )
    await s.execute(delete(Episode).where(Episode.run_id == run_id, Episode.id.in_(ids)))
    return len(ids)


async def prune_run(
    sessions: async_sessionmaker[AsyncSession], run_id: str, cfg: RunConfig, now: datetime
) -> int:
    """Delete every evaluation episode of the run over its retention; returns how many."""
    total = 0
    while True:
        async with sessions.begin() as s:
            ids = await over_retention(s, run_id, cfg, now)
            deleted = await delete_eval_episodes(s, run_id, ids)
        total += deleted
        if len(ids) < CHUNK or not deleted:
            return total


async def prune_all(sessions: async_sessionmaker[AsyncSession], now: datetime | None = None) -> int:
    """One retention pass over every run (paused and stopped ones too); returns how many
    evaluation episodes were deleted."""
    now = now or datetime.now(UTC)
    async with sessions() as s:
        runs = (await s.execute(select(Run.id, Run.config))).tuples().all()
    total = 0
    for run_id, config in runs:
        try:
            cfg = RunConfig.model_validate(config or {})
        except ValueError:
            logger.warning("run %s: config unreadable, its evaluation episodes are kept", run_id)
            continue
        if deleted := await prune_run(sessions, run_id, cfg, now):
            logger.info("run %s: %d evaluation episodes past retention deleted", run_id, deleted)
            total += deleted
    return total


class EvalRetention:
    """Runs `prune_all` at most every `interval_s` (monotonic), when asked by the leader."""

    def __init__(
        self, sessions: async_sessionmaker[AsyncSession], interval_s: float = INTERVAL_S
    ) -> None:
        self.sessions = sessions
        self.interval_s = interval_s
        # the first pass one interval after start: a gateway starting up has enough to do
        self._next = time.monotonic() + interval_s

    async def maybe_prune(self) -> int | None:
        """A pass if one is due (its count of deleted episodes), else None."""
        if time.monotonic() < self._next:
            return None
        self._next = time.monotonic() + self.interval_s
        return await prune_all(self.sessions)
