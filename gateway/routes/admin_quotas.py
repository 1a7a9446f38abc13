"""Admin API: a key's rate limit and token quota, and its usage (quotas need Redis)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from redis.exceptions import RedisError

from gateway.deps import AdminDep
from gateway.errors import InvalidRequest, NotFound, Unavailable
from gateway.services.quotas import Limits, QuotaService
from gateway.store.models import ApiKey

router = APIRouter(prefix="/admin/v1", dependencies=[AdminDep], tags=["admin"])


class KeyLimits(BaseModel):
    """`null` means unlimited (a key with no limits of its own uses the server defaults)."""

    model_config = ConfigDict(extra="forbid")

    requests_per_min: int | None = Field(None, ge=1, le=10**9)
    tokens_per_day: int | None = Field(None, ge=1, le=10**15)


class KeyQuota(KeyLimits):
    key_id: int
    requests_this_min: int
    tokens_today: int


async def _key_hash(request: Request, run_id: str, key_id: int) -> tuple[QuotaService, str]:
    quotas: QuotaService | None = request.app.state.quotas
    if quotas is None:
        raise InvalidRequest(
            "quotas are off: set RLGATE_QUOTA_REDIS_URL on the gateway", code="quotas_disabled"
        )
    async with request.app.state.sessions() as s:
        row = await s.get(ApiKey, key_id)
    if row is None or row.run_id != run_id:
        raise NotFound(f"no key {key_id} in run {run_id!r}", param="key_id")
    return quotas, row.key_hash


async def _quota(quotas: QuotaService, key_hash: str, key_id: int) -> KeyQuota:
    try:
        limits, usage = await quotas.limits(key_hash), await quotas.usage(key_hash)
    except RedisError as exc:
        raise Unavailable("the quota store (Redis) is unreachable", code="quota_store") from exc
    return KeyQuota(
        key_id=key_id,
        requests_per_min=limits.requests_per_min,
        tokens_per_day=limits.tokens_per_day,
        requests_this_min=usage.requests_this_min,
        tokens_today=usage.tokens_today,
    )


@router.get("/runs/{run_id}/keys/{key_id}/limits", response_model=KeyQuota)
async def get_limits(run_id: str, key_id: int, request: Request) -> KeyQuota:
    quotas, key_hash = await _key_hash(request, run_id, key_id)
    return await _quota(quotas, key_hash, key_id)


@router.put("/runs/{run_id}/keys/{key_id}/limits", response_model=KeyQuota)
async def set_limits(run_id: str, key_id: int, body: KeyLimits, request: Request) -> KeyQuota:
    """Replace the key's limits; they apply from its next request."""
    quotas, key_hash = await _key_hash(request, run_id, key_id)
    try:
        await quotas.set_limits(key_hash, Limits(body.requests_per_min, body.tokens_per_day))
    except RedisError as exc:
        raise Unavailable("the quota store (Redis) is unreachable", code="quota_store") from exc
    return await _quota(quotas, key_hash, key_id)
