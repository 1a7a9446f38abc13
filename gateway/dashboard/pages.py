"""What every dashboard view shares: the page renderer, its security headers and redirects.

Pages are rendered through `PagesDep` (the app's one `Pages`, built at start-up
by `install_dashboard`); actions answer POST-redirect-GET through `redirect`, with
the service's refusal in the `error` query parameter.
"""

from __future__ import annotations

import math
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import Depends, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from pydantic import ValidationError

from gateway.dashboard.auth import cookie_secure, current_session
from gateway.errors import APIError

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


class Pages:
    """Renders a template with what every page needs: the CSRF token, the error, the colours."""

    def __init__(self, templates: Jinja2Templates) -> None:
        self.templates = templates

    def render(self, request: Request, name: str, **ctx: Any) -> HTMLResponse:
        session = current_session(request)
        ctx |= {
            "csrf": session.csrf if session else "",
            "error": ctx.get("error") or request.query_params.get("error"),
            "colour": logprob_colour,
        }
        resp = self.templates.TemplateResponse(request, name, ctx)
        resp.headers.update(SECURITY_HEADERS)
        return resp


async def _pages(request: Request) -> Pages:
    pages: Pages = request.app.state.dashboard_pages
    return pages


PagesDep = Annotated[Pages, Depends(_pages)]


def redirect(url: str, error: str | None = None) -> RedirectResponse:
    """A 303 to `url` (POST-redirect-GET), carrying `error` for the page to show."""
    if error:
        url += ("&" if "?" in url else "?") + "error=" + quote(error)
    return RedirectResponse(url, status_code=303)


def set_cookie(response: Response, name: str, value: str, max_age: int, request: Request) -> None:
    """A dashboard cookie: HttpOnly, SameSite=Strict, Secure behind https (see `auth.py`)."""
    response.set_cookie(
        name,
        value,
        max_age=max_age,
        path=PREFIX,
        httponly=True,
        samesite="strict",
        secure=cookie_secure(request),
    )


def error_message(exc: Exception) -> str:
    """What a page shows of a refusal: the service's message, a form field's first error,
    or a parse error's first line."""
    if isinstance(exc, APIError):
        return exc.message
    if isinstance(exc, ValidationError) and exc.errors():
        first = exc.errors()[0]
        return f"{'.'.join(map(str, first['loc']))}: {first['msg']}"[:300]
    return str(exc).splitlines()[0][:300]
