"""The dashboard: server-rendered pages over the admin services, plus a JSON feed for polling.

Pages need a session (else a redirect to the login form); every POST needs
the session's CSRF token (else 403, see `auth.py`). Actions redirect back
(POST-redirect-GET) with an `error` query parameter when the service refused.
"""

from __future__ import annotations

import json
import math
import secrets
from importlib.resources import files
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from core.store.status import EpisodeStatus
from gateway.dashboard.analysis import RUN_CHARTS, episode_filters, install_analysis
from gateway.dashboard.auth import (
    LOGIN_CSRF_COOKIE,
    SESSION_COOKIE,
    LoginRequired,
    check_csrf,
    cookie_secure,
    current_session,
    end_session,
    read_form,
    session_post,
)
from gateway.deps import AgentBaseUrlDep, FeedSessionDep, PageSessionDep
from gateway.errors import APIError
from gateway.keys import DEV_KEY_OFF_LOOPBACK, admin_key_matches, dev_key_refused
from gateway.protocol import RunCreate

PREFIX = "/dashboard"
SECURITY_HEADERS = {
    # Token colours are inline styles; no script runs from anywhere but our own static files.
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; frame-ancestors 'none'; form-action 'self'",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def logprob_colour(logprob: float | None) -> str:
    """Red for improbable sampled tokens through yellow to green for near-certain ones."""
    if logprob is None or not math.isfinite(logprob):
        return "hsl(0, 0%, 88%)"
    p = min(max(math.exp(logprob), 0.0), 1.0)
    return f"hsl({round(120 * p)}, 75%, 78%)"


def _redirect(url: str, error: str | None = None) -> RedirectResponse:
    if error:
        url += ("&" if "?" in url else "?") + "error=" + quote(error)
    return RedirectResponse(url, status_code=303)


def _cookie(response: Response, name: str, value: str, max_age: int, request: Request) -> None:
    response.set_cookie(
        name,
        value,
        max_age=max_age,
        path=PREFIX,
        httponly=True,
        samesite="strict",
        secure=cookie_secure(request),
    )


def make_router(templates: Jinja2Templates) -> APIRouter:
    router = APIRouter(prefix=PREFIX, include_in_schema=False)

    def page(request: Request, name: str, **ctx: Any) -> HTMLResponse:
        session = current_session(request)
        ctx |= {
            "csrf": session.csrf if session else "",
            "error": ctx.get("error") or request.query_params.get("error"),
            "colour": logprob_colour,
        }
        resp = templates.TemplateResponse(request, name, ctx)
        resp.headers.update(SECURITY_HEADERS)
        return resp

    @router.get("/login")
    async def login_form(request: Request) -> Response:
        token = secrets.token_urlsafe(24)
        resp = page(request, "login.html", login_csrf=token)
        _cookie(resp, LOGIN_CSRF_COOKIE, token, 600, request)
        return resp

    @router.post("/login")
    async def login(request: Request) -> Response:
        form = await read_form(request)
        check_csrf(request, form, request.cookies.get(LOGIN_CSRF_COOKIE, ""))
        expected = request.app.state.admin_key
        if not admin_key_matches(form.get("admin_key", ""), expected):
            return _redirect(f"{PREFIX}/login", "wrong admin key")
        if dev_key_refused(expected, request.client and request.client.host):
            return _redirect(f"{PREFIX}/login", DEV_KEY_OFF_LOOPBACK)
        cookie, _ = request.app.state.dashboard_signer.issue()
        resp = _redirect(f"{PREFIX}/")
        _cookie(resp, SESSION_COOKIE, cookie, request.app.state.dashboard_signer.ttl_s, request)
        resp.delete_cookie(LOGIN_CSRF_COOKIE, path=PREFIX)
        return resp

    @router.post("/logout")
    async def logout(request: Request) -> Response:
        session, _ = await session_post(request)
        await end_session(request, session)
        resp = _redirect(f"{PREFIX}/login")
        resp.delete_cookie(SESSION_COOKIE, path=PREFIX)
        return resp

    @router.get("/", dependencies=[PageSessionDep])
    async def runs_page(request: Request, base_url: AgentBaseUrlDep) -> Response:
        return page(request, "runs.html", runs=await _runs_summary(request, base_url))

    @router.post("/runs")
    async def create_run(request: Request, base_url: AgentBaseUrlDep) -> Response:
        _, form = await session_post(request)
        try:
            config = json.loads(form.get("config") or "{}")
            body = RunCreate(name=form.get("name", ""), model=form.get("model", ""), config=config)
            created = await request.app.state.runs.create(body, base_url)
        except (ValueError, APIError) as exc:
            return _redirect(f"{PREFIX}/", _message(exc))
        return page(request, "created.html", run=created.model_dump())

    @router.get("/runs/{run_id}", dependencies=[PageSessionDep])
    async def run_page(run_id: str, request: Request, base_url: AgentBaseUrlDep) -> Response:
        st = request.app.state
        run = await st.runs.public(await st.runs.get(run_id), base_url)
        try:
            filters, parsed = episode_filters(request.query_params)
            episodes = await st.episode_admin.list(
                run_id,
                status=parsed["status"],
                reward_min=parsed["reward_min"],
                reward_max=parsed["reward_max"],
                version=parsed["version"],
                length_min=parsed["length_min"],
                length_max=parsed["length_max"],
                drift=parsed["drift"],
                group_id=parsed["group_id"],
                limit=100,
            )
        except (ValueError, APIError) as exc:
            return _redirect(f"{PREFIX}/runs/{run_id}", _message(exc))
        versions = [v.model_dump() for v in await st.run_admin.versions(run_id)]
        return page(
            request,
            "run.html",
            run=run.model_dump(),
            versions=versions,
            sink_errors=sum(int(v["metrics"].get("sink_errors", 0)) for v in versions),
            counters=(await st.metrics_admin.counters(run_id)).model_dump(),
            episodes=episodes.model_dump()["data"],
            has_more=episodes.has_more,
            filters=filters,
            run_charts=RUN_CHARTS,
        )

    @router.get("/runs/{run_id}/episodes/{episode_id}", dependencies=[PageSessionDep])
    async def episode_page(run_id: str, episode_id: str, request: Request) -> Response:
        detail = await request.app.state.episode_admin.detail(run_id, episode_id)
        return page(request, "episode.html", run_id=run_id, episode=detail.model_dump())

    @router.get("/runs/{run_id}/keys", dependencies=[PageSessionDep])
    async def keys_page(run_id: str, request: Request) -> Response:
        keys = await request.app.state.keys.list(run_id)
        return page(
            request, "keys.html", run_id=run_id, keys=[k.model_dump() for k in keys], new_key=None
        )

    @router.post("/runs/{run_id}/keys")
    async def create_key(run_id: str, request: Request) -> Response:
        await session_post(request)
        return await _key_page(request, run_id, await request.app.state.keys.create(run_id))

    @router.post("/runs/{run_id}/keys/{key_id}/{action}")
    async def key_action(run_id: str, key_id: int, action: str, request: Request) -> Response:
        await session_post(request)
        keys = request.app.state.keys
        if action == "revoke":
            await keys.revoke(run_id, key_id)
            return _redirect(f"{PREFIX}/runs/{run_id}/keys")
        if action == "rotate":
            return await _key_page(request, run_id, await keys.rotate(run_id, key_id))
        return _redirect(f"{PREFIX}/runs/{run_id}/keys", f"no action {action!r}")

    async def _key_page(request: Request, run_id: str, created: Any) -> Response:
        keys = await request.app.state.keys.list(run_id)
        return page(
            request,
            "keys.html",
            run_id=run_id,
            keys=[k.model_dump() for k in keys],
            new_key=created.api_key,
        )

    @router.get("/api/runs", dependencies=[FeedSessionDep])
    async def runs_feed(request: Request, base_url: AgentBaseUrlDep) -> JSONResponse:
        runs = await _runs_summary(request, base_url)
        return JSONResponse({"runs": runs}, headers=SECURITY_HEADERS)

    @router.get("/api/runs/{run_id}/live", dependencies=[FeedSessionDep])
    async def run_feed(run_id: str, request: Request, base_url: AgentBaseUrlDep) -> JSONResponse:
        """What the run page polls: status, versions, metric series, counters."""
        st = request.app.state
        run = await st.runs.public(await st.runs.get(run_id), base_url)
        series = await st.metrics_admin.series(run_id)
        versions = await st.run_admin.versions(run_id)
        counters = await st.metrics_admin.counters(run_id)
        return JSONResponse(
            {
                "run": {
                    k: run.model_dump()[k]
                    for k in ("name", "status", "current_version", "served_version", "created_at")
                },
                "metrics": series.model_dump(),
                "versions": [v.model_dump() for v in versions],
                "counters": counters.model_dump(),
            },
            headers=SECURITY_HEADERS,
        )

    install_analysis(router, page, _runs_summary)

    # Last: `{action}` would otherwise capture /runs/{id}/keys.
    @router.post("/runs/{run_id}/{action}")
    async def run_action(run_id: str, action: str, request: Request) -> Response:
        await session_post(request)
        if action not in ("pause", "resume", "stop"):
            return _redirect(f"{PREFIX}/runs/{run_id}", f"no action {action!r}")
        try:
            await request.app.state.runs.set_status(run_id, action)
        except APIError as exc:
            return _redirect(f"{PREFIX}/runs/{run_id}", exc.message)
        return _redirect(f"{PREFIX}/runs/{run_id}")

    return router


def _message(exc: Exception) -> str:
    return exc.message if isinstance(exc, APIError) else str(exc).splitlines()[0][:300]


async def _runs_summary(request: Request, base_url: str) -> list[dict[str, Any]]:
    """Each run with its status, versions, last rewards (sparkline) and last tokens/s."""
    st = request.app.state
    out = []
    for r in await st.runs.list():
        public = await st.runs.public(r, base_url)
        series = await st.metrics_admin.series(r.id)
        rewards = [p.values["reward_mean"] for p in series.points[-50:]]
        last = series.points[-1].values if series.points else {}
        rewards = [x for x in rewards if x is not None]
        out.append(
            {
                "run_id": r.id,
                "name": r.name,
                "model": r.model,
                "status": r.status,
                "current_version": r.current_version,
                "served_version": public.served_version,
                "rewards": rewards,
                "last_reward": rewards[-1] if rewards else None,
                "tokens_per_s": last.get("tokens_per_s"),
                "steps": len(series.points),
                "created_at": public.created_at,
            }
        )
    return out


def install_dashboard(app: FastAPI) -> None:
    """Mount the static files and pages; the session signer is set in the lifespan."""
    root = files("gateway.dashboard")
    templates = Jinja2Templates(directory=str(root / "templates"))
    templates.env.globals["episode_statuses"] = [s.value for s in EpisodeStatus]  # filter menu
    app.mount(
        f"{PREFIX}/static", StaticFiles(directory=str(root / "static")), name="dashboard-static"
    )
    app.include_router(make_router(templates))
    app.add_exception_handler(LoginRequired, _to_login)

    @app.get(PREFIX, include_in_schema=False)
    async def _bare() -> RedirectResponse:
        return RedirectResponse(f"{PREFIX}/", status_code=307)


async def _to_login(_: Request, __: Exception) -> Response:
    return _redirect(f"{PREFIX}/login")
