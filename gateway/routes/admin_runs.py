"""Admin API: update and delete runs; policy versions, checkpoint download, rollback.

See `gateway.services.admin_runs` for what delete does to in-flight work and
why rollback creates a new version instead of rewinding.
"""

from __future__ import annotations

from fastapi import APIRouter, Path, Request
from fastapi.responses import StreamingResponse

from gateway.deps import AdminDep
from gateway.protocol import RunPublic
from gateway.protocol_admin import PolicyVersionPublic, RollbackResult, RunDeleted, RunUpdate
from gateway.routes.admin import agent_base_url
from gateway.services.admin_runs import tar_stream

router = APIRouter(prefix="/admin/v1", dependencies=[AdminDep], tags=["admin"])

TAR_MEDIA_TYPE = "application/x-tar"


@router.patch("/runs/{run_id}", response_model=RunPublic)
async def update_run(run_id: str, body: RunUpdate, request: Request) -> RunPublic:
    """Rename a run and/or change config knobs that are safe live (others get 400)."""
    run = await request.app.state.run_admin.update(run_id, body)
    return await request.app.state.runs.public(run, agent_base_url(request))


@router.delete("/runs/{run_id}", response_model=RunDeleted)
async def delete_run(run_id: str, request: Request) -> RunDeleted:
    """Only a stopped (or failed) run with no train step in flight; 409 otherwise."""
    await request.app.state.run_admin.delete(run_id)
    return RunDeleted(run_id=run_id)


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
    run_id: str, request: Request, version: int = Path(ge=0, le=2**31 - 1)
) -> StreamingResponse:
    """The version's checkpoint directory as an uncompressed tar stream."""
    root = await request.app.state.run_admin.checkpoint_dir(run_id, version)
    name = f"{run_id}-v{version}"
    return StreamingResponse(
        tar_stream(root, name),  # a sync iterator: Starlette reads it in a thread
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
