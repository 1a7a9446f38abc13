"""The dashboard: server-rendered pages over the admin services, plus a JSON feed for polling.

Pages need a session (else a redirect to the login form); every POST needs
the session's CSRF token (else 403, see `auth.py`). Actions redirect back
(POST-redirect-GET) with an `error` query parameter when the service refused.
Each resource's routes live in their own module (`login`, `runs`, `keys`,
`analysis`); this one puts them in order under `PREFIX`.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from core.store.status import EpisodeStatus
from gateway.dashboard import analysis, keys, login, runs
from gateway.dashboard.auth import LoginRequired
from gateway.dashboard.pages import PREFIX, Pages, redirect

__all__ = ["PREFIX", "install_dashboard", "make_router"]


def make_router() -> APIRouter:
    """Every dashboard route under `PREFIX`, in an order where none shadows another."""
    router = APIRouter(prefix=PREFIX, include_in_schema=False)
    for part in (login.router, runs.router, keys.router, analysis.router):
        router.include_router(part)
    # Last: `{action}` would otherwise capture /runs/{id}/keys.
    router.include_router(runs.actions)
    return router


def install_dashboard(app: FastAPI) -> None:
    """Mount the static files and pages; the session signer is set in the lifespan."""
    root = files("gateway.dashboard")
    templates = Jinja2Templates(directory=str(root / "templates"))
    templates.env.globals["episode_statuses"] = [s.value for s in EpisodeStatus]  # filter menu
    app.state.dashboard_pages = Pages(templates)
    app.mount(
        f"{PREFIX}/static", StaticFiles(directory=str(root / "static")), name="dashboard-static"
    )
    app.include_router(make_router())
    app.add_exception_handler(LoginRequired, _to_login)

    @app.get(PREFIX, include_in_schema=False)
    async def _bare() -> RedirectResponse:
        return RedirectResponse(f"{PREFIX}/", status_code=307)


async def _to_login(_: Request, __: Exception) -> Response:
    return redirect(f"{PREFIX}/login")
