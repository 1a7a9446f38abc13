"""Admin API: metric time series, drift and drop counters, trainer workers and queue."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from gateway.deps import AdminDep
from gateway.protocol_admin import CountersPublic, MetricSeries, WorkersStatus

router = APIRouter(prefix="/admin/v1", dependencies=[AdminDep], tags=["admin"])


@router.get("/runs/{run_id}/metrics", response_model=MetricSeries)
async def run_metrics(
    run_id: str,
    request: Request,
    since_step: Annotated[int, Query(ge=-1, le=2**31 - 1)] = -1,
) -> MetricSeries:
    """One point per finished train step (step, version, time), oldest first."""
    return await request.app.state.metrics_admin.series(run_id, since_step)


@router.get("/runs/{run_id}/counters", response_model=CountersPublic)
async def run_counters(run_id: str, request: Request) -> CountersPublic:
    """Template drift, dropped and skipped samples by reason, episodes by status."""
    return await request.app.state.metrics_admin.counters(run_id)


@router.get("/workers", response_model=WorkersStatus)
async def workers(request: Request) -> WorkersStatus:
    """Celery workers (inspect, about 1 s timeout) and the training queue."""
    return await request.app.state.worker_admin.status()
