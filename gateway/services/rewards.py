"""Rewards: validate the target, store the post once, update the episode, maybe schedule."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.errors import Conflict, NotFound
from gateway.protocol import RewardAck, RewardRequest
from gateway.store import repo
from gateway.store.models import Completion, Episode, Reward, Run


class RewardService:
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self.sessions = sessions

    async def post(self, run: Run, body: RewardRequest) -> RewardAck:
        if body.idempotency_key is not None:
            prior = await self._replay(run, body)
            if prior is not None:
                return prior
        try:
            async with self.sessions.begin() as s:
                return await self._apply(s, run, body)
        except IntegrityError:
            # A concurrent post with the same idempotency key won the insert.
            prior = await self._replay(run, body) if body.idempotency_key else None
            if prior is None:
                raise
            return prior

    async def _apply(self, s: AsyncSession, run: Run, body: RewardRequest) -> RewardAck:
        completion = None
        if body.completion_id is not None:
            completion = await s.get(Completion, body.completion_id)
            if completion is None or completion.run_id != run.id:
                raise NotFound(
                    f"no completion {body.completion_id!r} in this run", param="completion_id"
                )
            episode_id = completion.episode_id
        else:
            episode_id = body.episode_id
        episode = await s.get(Episode, (run.id, episode_id))
        if episode is None:
            raise NotFound(f"no episode {episode_id!r} in this run", param="episode_id")
        row = Reward(
            run_id=run.id,
            completion_id=body.completion_id,
            episode_id=episode_id,
            value=body.reward,
            idempotency_key=body.idempotency_key,
        )
        s.add(row)
        if episode.status in ("open", "rewarded"):
            if completion is not None:
                completion.reward = body.reward
            else:
                episode.reward = body.reward
            await s.flush()
            await repo.refresh_episode_status(s, episode)
        else:
            # Late: the episode is already queued, trained or dropped. Stored, not trained.
            run_row = await s.get(Run, run.id)
            repo.bump_counter(run_row, "late_rewards")
        await s.flush()
        return RewardAck(
            id=row.id,
            run_id=run.id,
            completion_id=body.completion_id,
            episode_id=episode_id,
            reward=body.reward,
            episode_status=episode.status,
        )

    async def _replay(self, run: Run, body: RewardRequest) -> RewardAck | None:
        async with self.sessions() as s:
            prior = (
                await s.execute(
                    select(Reward).where(
                        Reward.run_id == run.id, Reward.idempotency_key == body.idempotency_key
                    )
                )
            ).scalar_one_or_none()
            if prior is None:
                return None
            same = (
                prior.value == body.reward
                and prior.completion_id == body.completion_id
                and (body.episode_id is None or prior.episode_id == body.episode_id)
            )
            if not same:
                raise Conflict(
                    "idempotency_key was already used with a different body",
                    param="idempotency_key",
                    code="idempotency_conflict",
                )
            episode = await s.get(Episode, (run.id, prior.episode_id))
            return RewardAck(
                id=prior.id,
                run_id=run.id,
                completion_id=prior.completion_id,
                episode_id=prior.episode_id,
                reward=prior.value,
                episode_status=episode.status if episode else "unknown",
                duplicate=True,
            )
