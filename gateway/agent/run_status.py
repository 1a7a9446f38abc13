"""Where a run and an agent's samples stand: GET /v1/runs/self and a reward's `progress`.

A synchronous agent (send a batch, wait for the version to move, repeat)
must be able to tell why the version does not move. The answer has the
run's version, what the next step has and needs, the admission capacity,
and what happened to an episode and its group:

* settled episodes answer from the store: queued or trained (with the step,
  `episodes.train_step`), dropped (with the batch policy's verdict kept in
  `episodes.verdict`: stale, skipped_zero_variance, dropped_incomplete) or
  expired;
* pending ones (open, rewarded) answer from the batch policy run read-only
  on the current snapshot, i.e. what the scheduler's next pass will decide:
  open, waiting (incomplete group), ready, or the drop that is coming.

The snapshot is the run's unconsumed episodes, which admission bounds, so
one answer costs a few small queries.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from core.store.episodes import batch_snapshot, episodes_with_groups
from core.store.models import Episode, Run
from core.store.status import UNGROUPED, EpisodeStatus
from core.store.steps import step_in_flight
from gateway.control.admission import Admission
from gateway.control.batch_policy import BatchConfig, BatchDecision, Verdict, select_batch
from gateway.errors import NotFound
from gateway.protocol import AdmissionState, NextStep, RewardAck, RunProgress, SampleState
from trainer.config import RunConfig

# A group's state is its most advanced member's, in this order.
_PRIORITY = (
    "trained",
    "queued",
    Verdict.ZERO_VARIANCE,
    Verdict.STALE,
    Verdict.INCOMPLETE,
    "dropped",
    "ready",
    "waiting",
    "open",
    "expired",
    "eval",
)


class RunStatusService:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], admission: Admission) -> None:
        self.sessions = sessions
        self.admission = admission

    async def progress(
        self, run_id: str, episode_id: str | None = None, group_id: str | None = None
    ) -> RunProgress:
        """The run's progress, with the state of `episode_id` and of `group_id` (or its group)."""
        (answer,) = await self.progress_many(run_id, [(episode_id, group_id)])
        if episode_id is not None and answer.episode is None:
            raise NotFound(f"no episode {episode_id!r} in this run", param="episode_id")
        if group_id is not None and answer.group is None:
            raise NotFound(f"no group {group_id!r} in this run", param="group_id")
        return answer

    async def with_progress(self, run_id: str, acks: list[RewardAck]) -> list[RewardAck]:
        """Reward acknowledgements with where each episode and its group stand now."""
        answers = await self.progress_many(run_id, [(a.episode_id, None) for a in acks])
        return [a.model_copy(update={"progress": p}) for a, p in zip(acks, answers, strict=True)]

    async def progress_many(
        self, run_id: str, asks: list[tuple[str | None, str | None]]
    ) -> list[RunProgress]:
        """One answer per (episode id, group id), sharing one read of the run."""
        async with self.sessions() as s:
            run = await s.get(Run, run_id)
            if run is None:
                raise NotFound(f"no run {run_id!r}", param="run_id")
            cfg = RunConfig.model_validate(run.config)
            snapshot = await batch_snapshot(s, run_id)
            decision = select_batch(
                snapshot, run.current_version, datetime.now(UTC), BatchConfig.from_run_config(cfg)
            )
            flight = await step_in_flight(s, run_id)
            usage = await self.admission.usage(s, run, cfg)
            rows = await episodes_with_groups(
                s, run_id, {e for e, _ in asks if e}, {g for _, g in asks if g}
            )
        episodes = {e.id: e for e in rows}
        members: dict[str, list[Episode]] = {}
        for e in episodes.values():
            members.setdefault(e.group_id, []).append(e)
        judge = _Judge(decision)
        base = RunProgress(
            run_id=run.id,
            status=run.status,
            version=run.current_version,
            next_step=NextStep(
                step=run.current_version + (1 if flight is not None else 0),
                ready_groups=sum(
                    g.verdict in (Verdict.READY, Verdict.CHOSEN) for g in decision.groups
                ),
                groups_per_step=cfg.groups_per_step,
                in_flight=flight is not None,
            ),
            admission=AdmissionState.model_validate(usage, from_attributes=True),
        )
        answers = []
        for episode_id, group_id in asks:
            ep = episodes.get(episode_id) if episode_id else None
            gid = group_id or (ep.group_id if ep is not None else None)
            group = members.get(gid, []) if gid and gid != UNGROUPED else []
            answers.append(
                base.model_copy(
                    update={
                        "episode": judge.episode(ep) if ep is not None else None,
                        "group": judge.group(gid, group) if gid and group else None,
                    }
                )
            )
        return answers


class _Judge:
    """States from the store for settled episodes, from the read-only decision for pending ones."""

    def __init__(self, decision: BatchDecision) -> None:
        self.live = {e: g.verdict for g in decision.groups for e in g.episode_ids}
        self.expired = set(decision.expired)

    def state(self, ep: Episode) -> str:
        if ep.status == EpisodeStatus.EVAL:
            return "eval"  # held out: scored, never trained
        if ep.status in (EpisodeStatus.QUEUED, EpisodeStatus.TRAINED):
            return str(ep.status)
        if ep.status == EpisodeStatus.DROPPED:
            return ep.verdict or "dropped"
        if ep.status == EpisodeStatus.EXPIRED or ep.id in self.expired:
            return "expired"
        verdict = self.live.get(ep.id)
        if verdict is None or verdict is Verdict.WAITING:
            return "open" if ep.status == EpisodeStatus.OPEN else "waiting"
        if verdict in (Verdict.READY, Verdict.CHOSEN):
            return "ready"
        return str(verdict)  # the drop the next pass will store

    def episode(self, ep: Episode) -> SampleState:
        return SampleState(id=ep.id, state=self.state(ep), step=ep.train_step)

    def group(self, group_id: str, members: list[Episode]) -> SampleState:
        states = [self.state(e) for e in members]
        state = min(states, key=_PRIORITY.index)
        steps = [e.train_step for e in members if e.train_step is not None]
        step = max(steps) if state in ("queued", "trained") and steps else None
        return SampleState(id=group_id, state=state, step=step, episodes=len(members))
