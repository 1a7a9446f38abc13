"""Dashboard sessions: a signed cookie after an admin-key login, and per-session CSRF tokens.

The cookie holds `{"sid", "exp", "csrf"}` signed with HMAC-SHA256 under a
key derived from the admin credential, so every gateway process sharing that
credential accepts it, and rotating the credential logs every session out.
Logging out records the session id in the store (`core.store.sessions`),
so the cookie, replayed afterwards, is refused by every process. It is
HttpOnly (scripts cannot read it), SameSite=Strict (other sites cannot make
the browser send it) and Secure when the request came over https or the
public URL is https (behind a TLS proxy the gateway itself sees http).
Every POST must also carry the session's CSRF token as the `csrf_token` form
field or the `X-CSRF-Token` header; the login form, which has no session yet,
uses a double-submit cookie instead.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass
from urllib.parse import parse_qs

from fastapi import Request

from core.store.sessions import is_revoked, revoke
from gateway.errors import AuthenticationFailed, PermissionDenied
from gateway.keys import dev_key_refused

SESSION_COOKIE = "rlgate_session"
LOGIN_CSRF_COOKIE = "rlgate_login_csrf"
SESSION_TTL_S = 12 * 3600
MAX_FORM_BYTES = 64 * 1024


class LoginRequired(Exception):
    """A page asked for without a session: the dashboard answers with a redirect to its login."""


@dataclass(frozen=True)
class Session:
    sid: str
    csrf: str
    expires: int


class SessionSigner:
    def __init__(self, admin_key: str, ttl_s: int = SESSION_TTL_S) -> None:
        self._key = hashlib.sha256(b"rlgate-dashboard-session\0" + admin_key.encode()).digest()
        self.ttl_s = ttl_s

    def _sign(self, payload: bytes) -> str:
        return hmac.new(self._key, payload, hashlib.sha256).hexdigest()

    def issue(self) -> tuple[str, Session]:
        session = Session(
            sid=secrets.token_hex(16),
            csrf=secrets.token_urlsafe(24),
            expires=int(time.time()) + self.ttl_s,
        )
        payload = json.dumps(
            {"sid": session.sid, "exp": session.expires, "csrf": session.csrf}
        ).encode()
        body = base64.urlsafe_b64encode(payload).decode().rstrip("=")
        return f"{body}.{self._sign(payload)}", session

    def verify(self, cookie: str | None) -> Session | None:
        if not cookie or "." not in cookie:
            return None
        body, _, sig = cookie.rpartition(".")
        try:
            payload = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        except ValueError:
            return None
        if not hmac.compare_digest(sig, self._sign(payload)):
            return None
        try:
            data = json.loads(payload)
            session = Session(
                sid=str(data["sid"]), csrf=str(data["csrf"]), expires=int(data["exp"])
            )
        except (ValueError, KeyError, TypeError):
            return None
        return session if session.expires > time.time() else None


def cookie_secure(request: Request) -> bool:
    """Whether the dashboard's cookies get the `Secure` flag."""
    public = request.app.state.settings.public_url.strip().lower()
    return request.url.scheme == "https" or public.startswith("https://")


def current_session(request: Request) -> Session | None:
    """The cookie's session if its signature, expiry and peer are good (not revocation: that
    needs the store, `active_session`)."""
    # Under the development admin key anyone can sign a cookie: loopback peers only then.
    if dev_key_refused(request.app.state.admin_key, request.client and request.client.host):
        return None
    return request.app.state.dashboard_signer.verify(request.cookies.get(SESSION_COOKIE))


async def active_session(request: Request) -> Session | None:
    """`current_session`, unless it was logged out."""
    session = current_session(request)
    if session is None:
        return None
    async with request.app.state.sessions() as s:
        return None if await is_revoked(s, session.sid) else session


async def end_session(request: Request, session: Session) -> None:
    """Log `session` out in every process sharing the store."""
    async with request.app.state.sessions() as s:
        await revoke(s, session.sid, session.expires)
        await s.commit()


async def require_session(request: Request) -> Session:
    """The caller's session, or 401 (what a POST or a JSON feed gets without one)."""
    session = await active_session(request)
    if session is None:
        raise AuthenticationFailed("log in to the dashboard first", code="no_session")
    return session


async def read_form(request: Request) -> dict[str, str]:
    """An urlencoded form body (what the dashboard's forms send), first value per field."""
    raw = await request.body()
    if len(raw) > MAX_FORM_BYTES:
        raise PermissionDenied("form too large", code="form_too_large")
    try:
        fields = parse_qs(raw.decode(), keep_blank_values=True, max_num_fields=100)
    except (UnicodeDecodeError, ValueError) as exc:
        raise PermissionDenied("unreadable form", code="bad_form") from exc
    return {k: v[0] for k, v in fields.items()}


def check_csrf(request: Request, form: dict[str, str], expected: str) -> None:
    given = request.headers.get("x-csrf-token") or form.get("csrf_token", "")
    if not expected or not hmac.compare_digest(given.encode(), expected.encode()):
        raise PermissionDenied("missing or wrong CSRF token", code="csrf_failed")


async def session_post(request: Request) -> tuple[Session, dict[str, str]]:
    """A logged-in POST with its form, its CSRF token checked (401 without session, 403 CSRF)."""
    session = await require_session(request)
    form = await read_form(request)
    check_csrf(request, form, session.csrf)
    return session, form
