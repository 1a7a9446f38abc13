"""Admin API (admin credential): runs, their lifecycle, their agent keys and steps.

Pause, resume and stop: a paused or stopped run answers new agent calls with 429
(`Retry-After`); requests already generating finish and are stored; no new
train step is scheduled for it (a step already queued or running completes).
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from gateway.deps import AdminDep
from gateway.protocol import (
    ApiKeyCreated,
    ApiKeyPublic,
    RunCreate,
    RunCreated,
    RunPublic,
    RunStatusChange,
    TrainStepPublic,
)

router = APIRouter(prefix="/admin/v1", dependencies=[AdminDep], tags=["admin"])


def agent_base_url(request: Request) -> str:
    public = request.app.state.settings.public_url
    base = public.rstrip("/") if public else str(request.base_url).rstrip("/")
    return base + "/v1"


@router.post("/runs", response_model=RunCreated, status_code=201)
async def create_run(body: RunCreate, request: Request) -> RunCreated:
    return await request.app.state.runs.create(body, agent_base_url(request))


@router.get("/runs", response_model=list[RunPublic])
async def list_runs(request: Request) -> list[RunPublic]:
    svc = request.app.state.runs
    return [await svc.public(r, agent_base_url(request)) for r in await svc.list()]


@router.get("/runs/{run_id}", response_model=RunPublic)
async def get_run(run_id: str, request: Request) -> RunPublic:
    svc = request.app.state.runs
    return await svc.public(await svc.get(run_id), agent_base_url(request))


@router.get("/runs/{run_id}/steps", response_model=list[TrainStepPublic])
async def list_steps(run_id: str, request: Request) -> list[TrainStepPublic]:
    return await request.app.state.runs.steps(run_id)


@router.get("/runs/{run_id}/keys", response_model=list[ApiKeyPublic])
async def list_keys(run_id: str, request: Request) -> list[ApiKeyPublic]:
    return await request.app.state.keys.list(run_id)


@router.post("/runs/{run_id}/keys", response_model=ApiKeyCreated, status_code=201)
async def create_key(run_id: str, request: Request) -> ApiKeyCreated:
    return await request.app.state.keys.create(run_id)


@router.post("/runs/{run_id}/keys/{key_id}/revoke", response_model=ApiKeyPublic)
async def revoke_key(run_id: str, key_id: int, request: Request) -> ApiKeyPublic:
    return await request.app.state.keys.revoke(run_id, key_id)


@router.post("/runs/{run_id}/keys/{key_id}/rotate", response_model=ApiKeyCreated, status_code=201)
async def rotate_key(run_id: str, key_id: int, request: Request) -> ApiKeyCreated:
    return await request.app.state.keys.rotate(run_id, key_id)


# Last: `{action}` would otherwise capture /runs/{id}/keys.
@router.post("/runs/{run_id}/{action}", response_model=RunStatusChange)
async def change_status(run_id: str, action: str, request: Request) -> RunStatusChange:
    """pause, resume or stop."""
    status = await request.app.state.runs.set_status(run_id, action)
    return RunStatusChange(run_id=run_id, status=status)
