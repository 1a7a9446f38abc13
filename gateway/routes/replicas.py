"""Admin API: the inference servers (replicas) of a vllm/sglang run.

A registered server joins the run's routing at once if the run is loaded
(after loading the run's current weights), or when the run is next loaded.
Removing one drains its requests first; removing the last unloads the run.
"""

from __future__ import annotations

from fastapi import APIRouter, Query, Request

from gateway.deps import AdminDep
from gateway.protocol import ReplicaCreate, ReplicaPublic

router = APIRouter(prefix="/admin/v1", dependencies=[AdminDep], tags=["admin"])


@router.get("/runs/{run_id}/replicas", response_model=list[ReplicaPublic])
async def list_replicas(run_id: str, request: Request) -> list[ReplicaPublic]:
    return await request.app.state.replicas.list(run_id)


@router.post("/runs/{run_id}/replicas", response_model=list[ReplicaPublic], status_code=201)
async def add_replica(run_id: str, body: ReplicaCreate, request: Request) -> list[ReplicaPublic]:
    return await request.app.state.replicas.add(run_id, body.url)


@router.delete("/runs/{run_id}/replicas", response_model=list[ReplicaPublic])
async def remove_replica(
    run_id: str, request: Request, url: str = Query(min_length=8, max_length=500)
) -> list[ReplicaPublic]:
    return await request.app.state.replicas.remove(run_id, url)
