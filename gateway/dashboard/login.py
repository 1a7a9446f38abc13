"""Dashboard login and logout: the admin key buys a signed session cookie (see `auth.py`)."""

from __future__ import annotations

import secrets

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.dashboard.auth import (
    LOGIN_CSRF_COOKIE,
    SESSION_COOKIE,
    check_csrf,
    end_session,
    read_form,
    session_post,
)
from gateway.dashboard.pages import PREFIX, PagesDep, redirect, set_cookie
from gateway.keys import DEV_KEY_OFF_LOOPBACK, admin_key_matches, dev_key_refused

router = APIRouter(include_in_schema=False)


@router.get("/login")
async def login_form(request: Request, pages: PagesDep) -> Response:
    token = secrets.token_urlsafe(24)
    resp = pages.render(request, "login.html", login_csrf=token)
    set_cookie(resp, LOGIN_CSRF_COOKIE, token, 600, request)
    return resp


@router.post("/login")
async def login(request: Request) -> Response:
    form = await read_form(request)
    check_csrf(request, form, request.cookies.get(LOGIN_CSRF_COOKIE, ""))
    expected = request.app.state.admin_key
    if not admin_key_matches(form.get("admin_key", ""), expected):
        return redirect(f"{PREFIX}/login", "wrong admin key")
    if dev_key_refused(expected, request.client and request.client.host):
        return redirect(f"{PREFIX}/login", DEV_KEY_OFF_LOOPBACK)
    cookie, _ = request.app.state.dashboard_signer.issue()
    resp = redirect(f"{PREFIX}/")
    set_cookie(resp, SESSION_COOKIE, cookie, request.app.state.dashboard_signer.ttl_s, request)
    resp.delete_cookie(LOGIN_CSRF_COOKIE, path=PREFIX)
    return resp


@router.post("/logout")
async def logout(request: Request) -> Response:
    session, _ = await session_post(request)
    await end_session(request, session)
    resp = redirect(f"{PREFIX}/login")
    resp.delete_cookie(SESSION_COOKIE, path=PREFIX)
    return resp
