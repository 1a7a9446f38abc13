"""Admin API (admin credential): create and inspect runs and their training steps."""

from __future__ import annotations

from fastapi import APIRouter, Request

from gateway.deps import AdminDep
from gateway.protocol import RunCreate, RunCreated, RunPublic, TrainStepPublic

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
