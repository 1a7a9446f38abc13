"""Agent keys of a run: mint (shown once), list by prefix, revoke, rotate. Stored hashed."""

from __future__ import annotations

from datetime import UTC, datetime

from redis.exceptions import RedisError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from core.store.keys import run_keys
from core.store.models import ApiKey, Run
from gateway.errors import NotFound, Unavailable
from gateway.keys import display_prefix, hash_key, new_key
from gateway.middleware.quotas import QuotaService
from gateway.protocol import ApiKeyCreated, ApiKeyPublic


def _public(row: ApiKey) -> ApiKeyPublic:
    return ApiKeyPublic(
        id=row.id,
        run_id=row.run_id,
        prefix=row.prefix,
        created_at=row.created_at.isoformat(),
        revoked_at=row.revoked_at.isoformat() if row.revoked_at else None,
    )


class KeyService:
    """`quotas`: the quota store whose per-key limits a rotation carries over (None: off)."""

    def __init__(
        self, sessions: async_sessionmaker[AsyncSession], quotas: QuotaService | None = None
    ) -> None:
        self.sessions = sessions
        self.quotas = quotas

    async def create(self, run_id: str) -> ApiKeyCreated:
        key = new_key()
        async with self.sessions.begin() as s:
            if await s.get(Run, run_id) is None:
                raise NotFound(f"no run {run_id!r}", param="run_id")
            row = ApiKey(run_id=run_id, prefix=display_prefix(key), key_hash=hash_key(key))
            s.add(row)
            await s.flush()
            return ApiKeyCreated(**_public(row).model_dump(), api_key=key)

    async def list(self, run_id: str) -> list[ApiKeyPublic]:
        async with self.sessions() as s:
            if await s.get(Run, run_id) is None:
                raise NotFound(f"no run {run_id!r}", param="run_id")
            return [_public(r) for r in await run_keys(s, run_id)]

    async def revoke(self, run_id: str, key_id: int) -> ApiKeyPublic:
        """Takes effect on the next request: every call looks its key up in the store."""
        async with self.sessions.begin() as s:
            row = await s.get(ApiKey, key_id)
            if row is None or row.run_id != run_id:
                raise NotFound(f"no key {key_id} in run {run_id!r}", param="key_id")
            if row.revoked_at is None:
                row.revoked_at = datetime.now(UTC)
            return _public(row)

    async def rotate(self, run_id: str, key_id: int) -> ApiKeyCreated:
        """A new key for the run, and the old one revoked, in one transaction; the old key's
        own limits (`gateway.middleware.quotas`) apply to the new one.

        The limits are copied before the commit: if the quota store cannot be reached the
        rotation fails whole (503) rather than mint a key that escapes its limits.
        """
        key = new_key()
        async with self.sessions.begin() as s:
            old = await s.get(ApiKey, key_id)
            if old is None or old.run_id != run_id:
                raise NotFound(f"no key {key_id} in run {run_id!r}", param="key_id")
            old.revoked_at = old.revoked_at or datetime.now(UTC)
            row = ApiKey(run_id=run_id, prefix=display_prefix(key), key_hash=hash_key(key))
            s.add(row)
            await s.flush()
            if self.quotas is not None:
                try:
                    await self.quotas.copy_limits(old.key_hash, row.key_hash)
                except RedisError as exc:
                    raise Unavailable(
                        "the quota store (Redis) is unreachable; the key was not rotated",
                        code="quota_store",
                    ) from exc
            return ApiKeyCreated(**_public(row).model_dump(), api_key=key)
