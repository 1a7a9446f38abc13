"""Admin API (admin credential): runs, their lifecycle, train steps and policy versions.

Pause, resume and stop: a paused or stopped run answers new agent calls with 429
(`Retry-After`); requests already generating finish and are stored; no new
train step is scheduled for it (a step already queued or running completes).
See `gateway.admin.run_ops` for what delete does to in-flight work and
why rollback creates a new version instead of rewinding.
"""

from __future__ import annotations

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import StreamingResponse

from gateway.admin.run_ops import tar_stream
from gateway.deps import AdminDep, AgentBaseUrlDep
from gateway.protocol import RunCreate, RunCreated, RunPublic, RunStatusChange, TrainStepPublic
from gateway.protocol_admin import (
    PolicyCreate,
    PolicyVersionPublic,
    RollbackResult,
    RunDeleted,
    RunUpdate,
)
from gateway.scratch import ScratchStreamingResponse, remover

router = APIRouter(prefix="/admin/v1", dependencies=[AdminDep], tags=["admin"])

TAR_MEDIA_TYPE = "application/x-tar"


@router.post("/runs", response_model=RunCreated, status_code=201)
async def create_run(body: RunCreate, request: Request, base_url: AgentBaseUrlDep) -> RunCreated:
    return await request.app.state.runs.create(body, base_url)


@router.get("/runs", response_model=list[RunPublic])
async def list_runs(request: Request, base_url: AgentBaseUrlDep) -> list[RunPublic]:
    svc = request.app.state.runs
    return [await svc.public(r, base_url) for r in await svc.list()]


@router.get("/runs/{run_id}", response_model=RunPublic)
async def get_run(run_id: str, request: Request, base_url: AgentBaseUrlDep) -> RunPublic:
    svc = request.app.state.runs
    return await svc.public(await svc.get(run_id), base_url)


@router.patch("/runs/{run_id}", response_model=RunPublic)
async def update_run(
    run_id: str, body: RunUpdate, request: Request, base_url: AgentBaseUrlDep
) -> RunPublic:
    """Rename a run and/or change config knobs that are safe live (others get 400)."""
    run = await request.app.state.run_admin.update(run_id, body)
    return await request.app.state.runs.public(run, base_url)


@router.delete("/runs/{run_id}", response_model=RunDeleted)
async def delete_run(run_id: str, request: Request) -> RunDeleted:
    """Only a stopped (or failed) run with no train step in flight; 409 otherwise."""
    await request.app.state.run_admin.delete(run_id)
    return RunDeleted(run_id=run_id)


@router.get("/runs/{run_id}/steps", response_model=list[TrainStepPublic])
async def list_steps(run_id: str, request: Request) -> list[TrainStepPublic]:
    return await request.app.state.runs.steps(run_id)


@router.get("/runs/{run_id}/versions", response_model=list[PolicyVersionPublic])
async def list_versions(run_id: str, request: Request) -> list[PolicyVersionPublic]:
    """Every policy version, oldest first, with its train step's metrics and swap time."""
    return await request.app.state.run_admin.versions(run_id)


@router.get(
    "/runs/{run_id}/versions/{version}/checkpoint",
    response_class=StreamingResponse,
    responses={200: {"content": {TAR_MEDIA_TYPE: {}}}},
)
async def download_checkpoint(
    run_id: str,
    request: Request,
    version: int = Path(ge=0, le=2**31 - 1),
    merged: bool = Query(False, description="a LoRA version merged into its base model"),
) -> StreamingResponse:
    """The version's checkpoint directory as an uncompressed tar stream.

    `merged`: a full HF directory even for a LoRA run (its adapter merged into the base).
    """
    admin = request.app.state.run_admin
    name = f"{run_id}-v{version}"
    root, scratch = (
        await admin.merged_checkpoint(run_id, version)
        if merged
        else (await admin.checkpoint_dir(run_id, version), False)
    )
    # a merged scratch copy is removed when the answer ends, however the client leaves
    return ScratchStreamingResponse(
        tar_stream(root, name),  # a sync iterator: Starlette reads it in a thread
        cleanup=remover(root.parent) if scratch else lambda: None,
        media_type=TAR_MEDIA_TYPE,
        headers={"Content-Disposition": f'attachment; filename="{name}.tar"'},
    )


@router.post(
    "/runs/{run_id}/versions/{version}/rollback", response_model=RollbackResult, status_code=201
)
async def rollback(
    run_id: str, request: Request, version: int = Path(ge=0, le=2**31 - 1)
) -> RollbackResult:
    """Serve and train from `version`'s weights again, as a new version N+1."""
    return await request.app.state.run_admin.rollback(run_id, version)


@router.post("/runs/{run_id}/policies", response_model=RunPublic, status_code=201)
async def add_policy(
    run_id: str, body: PolicyCreate, request: Request, base_url: AgentBaseUrlDep
) -> RunPublic:
    """Add a policy to a live run that declares policies; the policy's run (docs/policies.md)."""
    svc = request.app.state.runs
    return await svc.public(await svc.add_policy(run_id, body), base_url)


# Last here, and this router is included after those of keys and replicas: `{action}` would
# otherwise capture POST /runs/{id}/keys and POST /runs/{id}/replicas.
@router.post("/runs/{run_id}/{action}", response_model=RunStatusChange)
async def change_status(run_id: str, action: str, request: Request) -> RunStatusChange:
    """pause, resume or stop."""
    status = await request.app.state.runs.set_status(run_id, action)
    return RunStatusChange(run_id=run_id, status=status)
