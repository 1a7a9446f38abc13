"""A key's limits and usage as the admin API shows them: the key found in its run, Redis as 503."""

from __future__ import annotations

from redis.exceptions import RedisError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from core.store import keys
from gateway.errors import InvalidRequest, NotFound, Unavailable
from gateway.middleware.quotas import Limits, QuotaService
from gateway.protocol_admin import KeyLimits, KeyQuota


class KeyQuotaAdmin:
    """`quotas` is None when the gateway runs without a quota store; every call is then a 400."""

    def __init__(
        self, quotas: QuotaService | None, sessions: async_sessionmaker[AsyncSession]
    ) -> None:
        self.quotas = quotas
        self.sessions = sessions

    async def get(self, run_id: str, key_id: int) -> KeyQuota:
        quotas, key_hash = await self._key_hash(run_id, key_id)
        return await _quota(quotas, key_hash, key_id)

    async def set(self, run_id: str, key_id: int, body: KeyLimits) -> KeyQuota:
        """Replace the key's limits; they apply from its next request."""
        quotas, key_hash = await self._key_hash(run_id, key_id)
        try:
            await quotas.set_limits(key_hash, Limits(body.requests_per_min, body.tokens_per_day))
        except RedisError as exc:
            raise _unreachable() from exc
        return await _quota(quotas, key_hash, key_id)

    async def _key_hash(self, run_id: str, key_id: int) -> tuple[QuotaService, str]:
        # Quotas off is the answer even for a key that does not exist: the request can never work.
        if self.quotas is None:
            raise InvalidRequest(
                "quotas are off: set RLGATE_QUOTA_REDIS_URL on the gateway", code="quotas_disabled"
            )
        async with self.sessions() as s:
            row = await keys.key_in_run(s, run_id, key_id)
        if row is None:
            raise NotFound(f"no key {key_id} in run {run_id!r}", param="key_id")
        return self.quotas, row.key_hash


async def _quota(quotas: QuotaService, key_hash: str, key_id: int) -> KeyQuota:
    try:
        limits, usage = await quotas.limits(key_hash), await quotas.usage(key_hash)
    except RedisError as exc:
        raise _unreachable() from exc
    return KeyQuota(
        key_id=key_id,
        requests_per_min=limits.requests_per_min,
        tokens_per_day=limits.tokens_per_day,
        requests_this_min=usage.requests_this_min,
        tokens_today=usage.tokens_today,
    )


def _unreachable() -> Unavailable:
    return Unavailable("the quota store (Redis) is unreachable", code="quota_store")
