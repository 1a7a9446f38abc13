"""Rewards: validate the target, store the post once, update the episode, maybe schedule."""

from __future__ import annotations

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from core.store.episodes import refresh_episode_status
from core.store.models import Completion, Episode, Reward, Run, utcnow
from core.store.rewards import reward_by_idempotency_key
from core.store.runs import bump_counter
from core.store.status import PENDING_EPISODE, EpisodeStatus
from gateway.agent.policies import PolicyRuns, declared_policies
from gateway.errors import Conflict, InvalidRequest, NotFound, Unprocessable
from gateway.protocol import RewardAck, RewardRequest
from gateway.rows import from_row
from trainer.config import RunConfig


class RewardService:
    def __init__(
        self, sessions: async_sessionmaker[AsyncSession], policies: PolicyRuns | None = None
    ) -> None:
        self.sessions = sessions
        self.policies = policies or PolicyRuns(sessions)

    async def post(self, run: Run, body: RewardRequest) -> RewardAck:
        return (await self.post_many(run, [body]))[0]

    async def post_many(self, run: Run, bodies: list[RewardRequest]) -> list[RewardAck]:
        """Store a batch all-or-nothing; each idempotency key is honoured once.

        A repeated key with the same body answers the original acknowledgement
        (`duplicate: true`); with a different body, 409. A concurrent post of the
        same key loses the insert race and is answered as a duplicate. The run's
        reward bounds apply to what is new: a replay answers its acknowledgement
        even if the bounds have narrowed since, because that reward is stored.
        """
        first_of = self._dedupe(bodies)
        for attempt in range(3):
            acks: list[RewardAck | None] = [None] * len(bodies)
            for i, body in enumerate(bodies):
                if body.idempotency_key is not None and first_of[i] == i:
                    acks[i] = await self._replay(run, body, body.idempotency_key)
            self._check_bounds(
                run, [b for i, b in enumerate(bodies) if first_of[i] == i and acks[i] is None]
            )
            try:
                async with self.sessions.begin() as s:
                    for i, body in enumerate(bodies):
                        if acks[i] is None and first_of[i] == i:
                            acks[i] = await self._apply(s, run, body)
            except IntegrityError:
                if attempt == 2:
                    raise
                continue  # a concurrent post with one of our keys won: replay it
            return [_ack_of(acks, i, j) for i, j in enumerate(first_of)]
        raise AssertionError("unreachable")

    @staticmethod
    def _dedupe(bodies: list[RewardRequest]) -> list[int]:
        """Index of the first item with the same idempotency key (409 on a different body)."""
        seen: dict[str, int] = {}
        first_of = []
        for i, body in enumerate(bodies):
            key = body.idempotency_key
            if key is None:
                first_of.append(i)
            elif key in seen:
                if bodies[seen[key]] != body:
                    raise Conflict(
                        f"idempotency_key {key!r} appears twice in the batch with different bodies",
                        param="idempotency_key",
                        code="idempotency_conflict",
                    )
                first_of.append(seen[key])
            else:
                seen[key] = i
                first_of.append(i)
        return first_of

    @staticmethod
    def _check_bounds(run: Run, bodies: list[RewardRequest]) -> None:
        cfg = RunConfig.model_validate(run.config)
        for body in bodies:
            if (cfg.reward_min is not None and body.reward < cfg.reward_min) or (
                cfg.reward_max is not None and body.reward > cfg.reward_max
            ):
                raise Unprocessable(
                    f"reward {body.reward} is outside this run's bounds "
                    f"[{cfg.reward_min}, {cfg.reward_max}]",
                    param="reward",
                    code="reward_out_of_bounds",
                )

    async def _apply(self, s: AsyncSession, run: Run, body: RewardRequest) -> RewardAck:
        """Store the post under the key's run; apply it to the episode it names, in each
        policy's run that has its turns (a run with policies: docs/policies.md)."""
        runs = await self._targets(run, body)
        completion = None
        if body.completion_id is not None:
            completion = await s.get(Completion, body.completion_id)
            if completion is None or completion.run_id not in runs:
                raise NotFound(
                    f"no completion {body.completion_id!r} in this run", param="completion_id"
                )
            episode_id = completion.episode_id
            runs = [completion.run_id]
        elif body.episode_id is not None:
            episode_id = body.episode_id
        else:  # RewardRequest names exactly one target
            raise AssertionError("a reward without a completion_id or an episode_id")
        episodes = [e for r in runs if (e := await s.get(Episode, (r, episode_id))) is not None]
        if not episodes:
            where = f"policy {body.policy!r} of this run" if body.policy else "this run"
            raise NotFound(f"no episode {episode_id!r} in {where}", param="episode_id")
        row = Reward(
            run_id=run.id,
            completion_id=body.completion_id,
            episode_id=episode_id,
            value=body.reward,
            idempotency_key=body.idempotency_key,
            policy=body.policy,
        )
        s.add(row)
        for episode in episodes:
            await _reward_episode(s, episode, completion, body.reward)
        await s.flush()
        return _ack(row, episodes[0].status)

    async def _targets(self, run: Run, body: RewardRequest) -> list[str]:
        """The runs a reward may reach: the key's run, or its policies' runs (the one named
        by `body.policy`, or all of them)."""
        names = declared_policies(run)
        if not names:
            if body.policy is not None:
                raise InvalidRequest("this run has no policies: drop policy", param="policy")
            return [run.id]
        policies = await self.policies.of(run.id)
        if body.policy is None:
            return [r.id for r in policies.values()]
        if body.policy not in policies:
            raise NotFound(
                f"no policy {body.policy!r} in this run; it has {', '.join(names)}",
                param="policy",
            )
        return [policies[body.policy].id]

    async def _replay(self, run: Run, body: RewardRequest, key: str) -> RewardAck | None:
        async with self.sessions() as s:
            prior = await reward_by_idempotency_key(s, run.id, key)
            if prior is None:
                return None
            same = (
                prior.value == body.reward
                and prior.completion_id == body.completion_id
                and (body.episode_id is None or prior.episode_id == body.episode_id)
                and prior.policy == body.policy
            )
            if not same:
                raise Conflict(
                    "idempotency_key was already used with a different body",
                    param="idempotency_key",
                    code="idempotency_conflict",
                )
            episodes = [
                await s.get(Episode, (r, prior.episode_id)) for r in await self._targets(run, body)
            ]
            status = next((e.status for e in episodes if e is not None), "unknown")
            return _ack(prior, status, duplicate=True)


async def _reward_episode(
    s: AsyncSession, episode: Episode, completion: Completion | None, value: float
) -> None:
    """A reward on `completion` (else on the whole episode), as the episode's state allows."""
    if episode.status == EpisodeStatus.EVAL:
        # Held out: scored, never trained. A later post revises the score.
        if completion is not None:
            completion.reward = value
        else:
            episode.reward = value
            episode.rewarded_at = utcnow()
    elif episode.status in PENDING_EPISODE:
        if completion is not None:
            completion.reward = value
        else:
            episode.reward = value
        await s.flush()
        await refresh_episode_status(s, episode)
    else:
        # Late: the episode is already queued, trained or dropped. Stored, not trained.
        bump_counter(await s.get_one(Run, episode.run_id), "late_rewards")


def _ack(row: Reward, episode_status: str, duplicate: bool = False) -> RewardAck:
    """The acknowledgement of a stored reward: the same for its first post and a replay."""
    return from_row(
        RewardAck, row, reward=row.value, episode_status=episode_status, duplicate=duplicate
    )


def _ack_of(acks: list[RewardAck | None], i: int, first: int) -> RewardAck:
    """Item `i`'s acknowledgement: its own, or (a repeated key) its first's, as a duplicate."""
    ack = acks[first]
    if ack is None:  # every first occurrence was replayed or applied
        raise AssertionError(f"reward {first} of the batch has no acknowledgement")
    return ack if first == i else ack.model_copy(update={"duplicate": True})
