"""FastAPI dependencies: services from app.state, the caller's run, the admin check."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from gateway.errors import AuthenticationFailed
from gateway.keys import admin_key_matches, hash_key
from gateway.store import repo
from gateway.store.models import Run


def _bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationFailed(
            "missing API key: send it as 'Authorization: Bearer <key>'", code="missing_api_key"
        )
    return token.strip()


async def current_run(request: Request) -> Run:
    """The run whose agent key the caller presented (revoked keys do not count).

    Looked up through the app's `RunKeyCache` (see there for when a change is seen).
    """
    key_hash = hash_key(_bearer(request))
    cache = request.app.state.run_keys
    run = cache.get(key_hash)
    if run is None:
        generation = cache.generation
        async with request.app.state.sessions() as s:
            run = await repo.run_for_key_hash(s, key_hash)
        if run is None:
            raise AuthenticationFailed("invalid API key", code="invalid_api_key")
        cache.put(key_hash, run, generation)
    return run


async def require_admin(request: Request) -> None:
    if not admin_key_matches(_bearer(request), request.app.state.admin_key):
        raise AuthenticationFailed("admin credential required", code="invalid_admin_key")


RunDep = Annotated[Run, Depends(current_run)]
AdminDep = Depends(require_admin)
