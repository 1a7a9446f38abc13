"""Admin API: a key's rate limit and token quota, and its usage (quotas need Redis)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from gateway.deps import AdminDep, KeyId
from gateway.protocol_admin import KeyLimits, KeyQuota

router = APIRouter(prefix="/admin/v1", dependencies=[AdminDep], tags=["admin"])


@router.get("/runs/{run_id}/keys/{key_id}/limits", response_model=KeyQuota)
async def get_limits(run_id: str, key_id: KeyId, request: Request) -> KeyQuota:
    return await request.app.state.key_quotas.get(run_id, key_id)


@router.put("/runs/{run_id}/keys/{key_id}/limits", response_model=KeyQuota)
async def set_limits(run_id: str, key_id: KeyId, body: KeyLimits, request: Request) -> KeyQuota:
    """Replace the key's limits; they apply from its next request."""
    return await request.app.state.key_quotas.set(run_id, key_id, body)
