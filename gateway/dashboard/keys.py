"""Dashboard pages for a run's agent keys: list, create, revoke, rotate.

A new or rotated key is shown once, on the page that answers the POST.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.dashboard.auth import session_post
from gateway.dashboard.pages import PREFIX, Pages, PagesDep, redirect
from gateway.deps import PageSessionDep

router = APIRouter(include_in_schema=False)


async def _keys_page(request: Request, pages: Pages, run_id: str, new_key: str | None) -> Response:
    keys = await request.app.state.keys.list(run_id)
    return pages.render(
        request, "keys.html", run_id=run_id, keys=[k.model_dump() for k in keys], new_key=new_key
    )


@router.get("/runs/{run_id}/keys", dependencies=[PageSessionDep])
async def keys_page(run_id: str, request: Request, pages: PagesDep) -> Response:
    return await _keys_page(request, pages, run_id, None)


@router.post("/runs/{run_id}/keys")
async def create_key(run_id: str, request: Request, pages: PagesDep) -> Response:
    await session_post(request)
    created = await request.app.state.keys.create(run_id)
    return await _keys_page(request, pages, run_id, created.api_key)


@router.post("/runs/{run_id}/keys/{key_id}/{action}")
async def key_action(
    run_id: str, key_id: int, action: str, request: Request, pages: PagesDep
) -> Response:
    await session_post(request)
    keys = request.app.state.keys
    if action == "revoke":
        await keys.revoke(run_id, key_id)
        return redirect(f"{PREFIX}/runs/{run_id}/keys")
    if action == "rotate":
        rotated = await keys.rotate(run_id, key_id)
        return await _keys_page(request, pages, run_id, rotated.api_key)
    return redirect(f"{PREFIX}/runs/{run_id}/keys", f"no action {action!r}")
