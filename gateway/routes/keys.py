"""Admin API: a run's agent keys (minted keys are shown once; the store keeps hashes)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from gateway.deps import AdminDep, KeyId
from gateway.protocol import ApiKeyCreated, ApiKeyPublic

router = APIRouter(prefix="/admin/v1", dependencies=[AdminDep], tags=["admin"])


@router.get("/runs/{run_id}/keys", response_model=list[ApiKeyPublic])
async def list_keys(run_id: str, request: Request) -> list[ApiKeyPublic]:
    return await request.app.state.keys.list(run_id)


@router.post("/runs/{run_id}/keys", response_model=ApiKeyCreated, status_code=201)
async def create_key(run_id: str, request: Request) -> ApiKeyCreated:
    return await request.app.state.keys.create(run_id)


@router.post("/runs/{run_id}/keys/{key_id}/revoke", response_model=ApiKeyPublic)
async def revoke_key(run_id: str, key_id: KeyId, request: Request) -> ApiKeyPublic:
    return await request.app.state.keys.revoke(run_id, key_id)


@router.post("/runs/{run_id}/keys/{key_id}/rotate", response_model=ApiKeyCreated, status_code=201)
async def rotate_key(run_id: str, key_id: KeyId, request: Request) -> ApiKeyCreated:
    return await request.app.state.keys.rotate(run_id, key_id)
