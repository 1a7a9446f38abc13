"""Dashboard sessions: `Secure` whenever the public URL is https, and revoked by logout.

A real gateway over plain http on loopback, as behind a TLS-terminating proxy:
the request scheme is http, the public URL https. Cookies are carried by hand
(httpx, like a browser, would not send a `Secure` cookie over http).
"""

from __future__ import annotations

import base64
import json
from http.cookies import SimpleCookie
from pathlib import Path

import httpx
import pytest

from rlgate.stack import stop
from tests.conftest import ADMIN_KEY

pytestmark = pytest.mark.integration


def _set_cookies(resp: httpx.Response) -> dict[str, SimpleCookie]:
    out = {}
    for header in resp.headers.get_list("set-cookie"):
        jar = SimpleCookie()
        jar.load(header)
        for name in jar:
            out[name] = jar
    return out


def _login(url: str) -> tuple[str, dict[str, SimpleCookie]]:
    """Log in with the admin key; (the session cookie's value, the cookies as first set)."""
    form = httpx.get(url + "/dashboard/login", timeout=30)
    login_cookies = _set_cookies(form)
    token = login_cookies["rlgate_login_csrf"]["rlgate_login_csrf"].value
    resp = httpx.post(
        url + "/dashboard/login",
        data={"admin_key": ADMIN_KEY, "csrf_token": token},
        headers={"Cookie": f"rlgate_login_csrf={token}"},
        timeout=30,
    )
    assert resp.status_code == 303 and resp.headers["location"] == "/dashboard/", resp.text
    cookies = _set_cookies(resp) | {"rlgate_login_csrf": login_cookies["rlgate_login_csrf"]}
    return cookies["rlgate_session"]["rlgate_session"].value, cookies


def _csrf(cookie: str) -> str:
    body = cookie.rpartition(".")[0]
    return json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))["csrf"]


def test_cookies_are_secure_when_the_public_url_is_https(gateway_launcher, tmp_path: Path) -> None:
    server = gateway_launcher(tmp_path / "data", public_url="https://rlgate.example.com")
    try:
        _, cookies = _login(server.url)
    finally:
        stop(server.proc)
    for name in ("rlgate_login_csrf", "rlgate_session"):
        morsel = cookies[name][name]
        assert morsel["secure"], (name, morsel.OutputString())
        assert morsel["httponly"] and morsel["samesite"].lower() == "strict"


def test_cookies_are_not_secure_on_plain_http(gateway_server) -> None:
    _, cookies = _login(gateway_server.url)
    assert not cookies["rlgate_session"]["rlgate_session"]["secure"]


def test_logout_revokes_the_session(gateway_server) -> None:
    url = gateway_server.url
    cookie, _ = _login(url)
    jar = {"Cookie": f"rlgate_session={cookie}"}
    assert httpx.get(url + "/dashboard/", headers=jar, timeout=30).status_code == 200
    assert httpx.get(url + "/dashboard/api/runs", headers=jar, timeout=30).status_code == 200

    out = httpx.post(
        url + "/dashboard/logout", headers=jar | {"X-CSRF-Token": _csrf(cookie)}, timeout=30
    )
    assert out.status_code == 303 and out.headers["location"] == "/dashboard/login"

    # The same cookie replayed after the logout, as a thief who copied it would.
    page = httpx.get(url + "/dashboard/", headers=jar, timeout=30)
    assert page.status_code == 303 and page.headers["location"].endswith("/dashboard/login")
    feed = httpx.get(url + "/dashboard/api/runs", headers=jar, timeout=30)
    assert feed.status_code == 401 and feed.json()["error"]["code"] == "no_session"
    post = httpx.post(
        url + "/dashboard/logout", headers=jar | {"X-CSRF-Token": _csrf(cookie)}, timeout=30
    )
    assert post.status_code == 401

    other, _ = _login(url)  # a new login still works
    again = httpx.get(url + "/dashboard/", headers={"Cookie": f"rlgate_session={other}"})
    assert again.status_code == 200
