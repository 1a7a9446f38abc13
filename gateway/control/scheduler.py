"""Decide when a run trains and enqueue its step: the scheduler, a task of its own."""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime, timedelta

from celery import Celery
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from core.store.episodes import (
    apply_batch_decision,
    batch_snapshot,
    mark_queued,
    release_step_episodes,
)
from core.store.models import Run, TrainStep, as_utc
from core.store.runs import active_run_ids, claim_signature, lock_run_for_claim
from core.store.status import StepStatus
from core.store.steps import delete_step, step_busy, step_in_flight
from gateway.control.batch_policy import BatchConfig, BatchDecision, Verdict, select_batch
from gateway.control.eval_retention import EvalRetention
from gateway.control.leader import AdvisoryLockLeader, SoleLeader
from trainer.config import RunConfig
from trainer.submit import submit_train_step

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 3  # per step, before the run is marked failed
# A dry pass is repeated at least this often even if nothing it watches changed (a safety
# net for edits the signature does not see, such as an operator's hand in the database).
IDLE_RESCAN_S = 60.0


class TrainingScheduler:
    """Enqueues at most one step per run at a time, as soon as a full batch is ready.

    The step row (run, step) is the lock: its primary key makes a second
    enqueue of the same step fail, and its status says whether one is in flight.

    A full pass (`_decide`) reads every open episode of the run under the
    claim's lock, lets `batch_policy.select_batch` judge them and stores the
    verdicts. A pass that found nothing to train records the run's signature
    (status, version, rewarded episodes) and the first moment the clock alone
    would change a verdict (an open episode expiring, a waiting group timing
    out). While the signature is unchanged, later passes skip the full read
    until that moment (at least `full_scan_s` after the pass, at most
    `IDLE_RESCAN_S`). New rewards, a new version or a resumed run change the
    signature and are acted on at the next pass. New open episodes do not:
    alone they never make a step. So a run with thousands of agents mid-episode
    and nothing to train costs two indexed reads a pass, not a read of every
    open episode every `full_scan_s`.

    Only the leader among the gateway processes sharing the store schedules
    (`gateway.control.leader`); in the others `maybe_schedule` does nothing.
    `run_forever` is its own task, apart from the swap loop
    (`gateway.control.swapper`), so a slow reload never holds a step back.
    """

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        celery: Celery,
        step_timeout_s: float = 1800.0,
        full_scan_s: float = 2.0,
        leader: SoleLeader | AdvisoryLockLeader | None = None,
    ) -> None:
        self.sessions = sessions
        self.leader = leader or SoleLeader()
        self.celery = celery
        self.step_timeout_s = step_timeout_s
        self.full_scan_s = full_scan_s
        self._locks: dict[str, asyncio.Lock] = {}
        # run -> (signature, when, until) of a dry pass: skip passes until `until` (monotonic)
        self._idle: dict[str, tuple[tuple, float, float]] = {}
        self.full_passes = 0  # a figure for tests: passes that read the whole batch
        # evaluation episodes past their run's retention, deleted now and then by the leader
        self.eval_retention = EvalRetention(sessions)

    async def maybe_schedule(self, run_id: str) -> int | None:
        if not self.leader.is_leader:
            return None  # another gateway process schedules
        lock = self._locks.setdefault(run_id, asyncio.Lock())
        async with lock:
            try:
                claim = await self._claim(run_id)
            except IntegrityError:
                return None  # another gateway process claimed this step
            if claim is None:
                return None
            step, resend = claim
            try:
                await asyncio.to_thread(submit_train_step, self.celery, run_id, step)
            except Exception:
                logger.exception("could not enqueue step %d of %s", step, run_id)
                if not resend:
                    await self._release(run_id, step)
                return None
            logger.info("enqueued step %d of run %s", step, run_id)
            return step

    async def _claim(self, run_id: str) -> tuple[int, bool] | None:
        """(step, resend): a new step to enqueue, or an in-flight one whose task went quiet.

        A step queued or running for longer than `step_timeout_s` is sent
        again under the same task id (its worker may have died: the embedded
        broker has already consumed the message). The task is idempotent, so
        a slow but alive first attempt and the resend cannot both bump the version.
        """
        now, now_mono = datetime.now(UTC), time.monotonic()  # one instant, on both clocks
        # A look without the lock first: while a step is in flight (most passes, and every
        # reward posted meanwhile) there is nothing to claim, and taking the write lock on
        # each pass would starve the trainer's own commit of that step.
        async with self.sessions() as s:
            if await step_busy(s, run_id, now - timedelta(seconds=self.step_timeout_s)):
                return None
            signature = await claim_signature(s, run_id)
        idle = self._idle.get(run_id)
        if idle and idle[0] == signature and time.monotonic() < idle[2]:
            return None  # nothing changed since a pass that found nothing
        self._idle.pop(run_id, None)
        async with self.sessions.begin() as s:
            run = await lock_run_for_claim(s, run_id)  # one consistent view, see there
            if run is None or run.status != "active":
                return None
            flight = await step_in_flight(s, run_id)
            if flight is not None:
                since = as_utc(flight.enqueued_at or flight.created_at)
                if (now - since).total_seconds() < self.step_timeout_s:
                    return None
                flight.enqueued_at = now
                flight.metrics = {
                    **(flight.metrics or {}),
                    "resent": (flight.metrics or {}).get("resent", 0) + 1,
                }
                logger.warning(
                    "step %d of run %s went quiet; sending it again", flight.step, run_id
                )
                return flight.step, True
            decision = await self._decide(s, run)
            if not decision.chosen:
                self._idle[run_id] = (signature, *self._skip_window(decision, now, now_mono))
                return None
            batch = decision.episode_ids
            step = run.current_version
            n_groups = len({g.train_group_id for g in decision.chosen})
            row = await s.get(TrainStep, (run_id, step))
            if row is None:
                row = TrainStep(run_id=run_id, step=step, metrics={"attempts": 1})
                s.add(row)
            elif row.status != StepStatus.FAILED:
                # Cannot happen under the claim's lock (the step of the current version is
                # either missing, failed or in flight); kept as a guard: never re-queue a row
                # the trainer may own.
                return None
            else:  # a failed attempt: retry it with a fresh batch, counting attempts per step
                attempts = int((row.metrics or {}).get("attempts", 1))
                if attempts >= MAX_ATTEMPTS:
                    run.status = "failed"
                    logger.error("run %s: step %d failed %d times", run_id, step, attempts)
                    return None
                # keep the last failure visible while the step is retried
                row.metrics = {"attempts": attempts + 1, "last_error": row.error}
            row.enqueued_at = now
            row.status, row.n_episodes, row.n_groups, row.error = (
                StepStatus.QUEUED,
                len(batch),
                n_groups,
                None,
            )
            await s.flush()
            await mark_queued(s, run_id, batch, step, Verdict.CHOSEN)
            return step, False

    def _skip_window(
        self, decision: BatchDecision, now: datetime, now_mono: float
    ) -> tuple[float, float]:
        """(when, until) in monotonic seconds: passes with an unchanged signature skip the
        full read until the clock changes a verdict, within [full_scan_s, IDLE_RESCAN_S].

        The window counts from `now_mono`, the monotonic reading taken with `now` (the
        instant the verdicts were judged at), not from the end of the pass: a slow pass
        would otherwise push the next verdict change late by its own length.
        """
        passed = now_mono
        wait_s = IDLE_RESCAN_S
        if decision.next_change is not None:
            wait_s = min(wait_s, (decision.next_change - now).total_seconds())
        return passed, passed + max(self.full_scan_s, wait_s)

    async def _decide(self, s: AsyncSession, run: Run) -> BatchDecision:
        """One full pass: read the pending episodes, judge them, store the verdicts.

        The expiries and drops are stored even when nothing trains yet.
        """
        self.full_passes += 1
        cfg = BatchConfig.from_run_config(RunConfig.model_validate(run.config))
        snapshot = await batch_snapshot(s, run.id)
        decision = select_batch(snapshot, run.current_version, datetime.now(UTC), cfg)
        await apply_batch_decision(
            s,
            run,
            expired=decision.expired,
            dropped=decision.dropped,
            regrouped=decision.regrouped,
            counters=decision.counters,
        )
        return decision

    async def _release(self, run_id: str, step: int) -> None:
        async with self.sessions.begin() as s:
            await release_step_episodes(s, run_id, step)
            await delete_step(s, run_id, step)

    async def active_runs(self) -> list[str]:
        async with self.sessions() as s:
            return await active_run_ids(s)

    async def schedule_once(self) -> None:
        """One pass: every active run gets a step if a batch is ready; evaluation episodes
        past retention are deleted when that is due (the leader only)."""
        if self.leader.is_leader:
            for run_id in await self.active_runs():
                await self.maybe_schedule(run_id)
            try:
                await self.eval_retention.maybe_prune()
            except asyncio.CancelledError:
                raise
            except Exception:  # never holds a step back; tried again at the next due pass
                logger.exception("evaluation retention pass failed")

    async def run_forever(self, interval_s: float) -> None:
        while True:
            try:
                await self.schedule_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("scheduling pass failed; retrying")
            await asyncio.sleep(interval_s)
