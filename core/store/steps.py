"""Train steps: what is in flight, a run's step history, and the queue as a whole."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from core.store.models import TrainStep, as_utc
from core.store.status import STEP_IN_FLIGHT, StepStatus


async def step_busy(session: AsyncSession, run_id: str, since: datetime) -> bool:
    """Whether a step of the run is queued or running and was (re)sent after `since`.

    A lock-free pre-check for the claim; the claim itself decides under its lock.
    """
    stmt = select(TrainStep.enqueued_at, TrainStep.created_at).where(
        TrainStep.run_id == run_id, TrainStep.status.in_(STEP_IN_FLIGHT)
    )
    return any(as_utc(sent or made) > since for sent, made in (await session.execute(stmt)).all())


async def step_in_flight(session: AsyncSession, run_id: str) -> TrainStep | None:
    stmt = select(TrainStep).where(TrainStep.run_id == run_id, TrainStep.status.in_(STEP_IN_FLIGHT))
    return (await session.execute(stmt)).scalars().first()


async def delete_step(session: AsyncSession, run_id: str, step: int) -> None:
    await session.execute(
        delete(TrainStep).where(TrainStep.run_id == run_id, TrainStep.step == step)
    )


async def run_steps(session: AsyncSession, run_id: str) -> list[TrainStep]:
    """Every step of the run, in order."""
    stmt = select(TrainStep).where(TrainStep.run_id == run_id).order_by(TrainStep.step)
    return list((await session.execute(stmt)).scalars())


async def done_steps(session: AsyncSession, run_id: str, after: int = -1) -> list[TrainStep]:
    """The run's finished steps past step `after`, in order."""
    stmt = (
        select(TrainStep)
        .where(
            TrainStep.run_id == run_id,
            TrainStep.status == StepStatus.DONE,
            TrainStep.step > after,
        )
        .order_by(TrainStep.step)
    )
    return list((await session.execute(stmt)).scalars())


async def pending_steps(session: AsyncSession) -> int:
    """Steps queued or running, over every run."""
    stmt = select(func.count()).where(TrainStep.status.in_(STEP_IN_FLIGHT))
    return int((await session.execute(stmt)).scalar_one())
