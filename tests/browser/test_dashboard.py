"""Must-show: log in, open a run holding real training data, charts drawn, tokens coloured.

Real uvicorn gateway, real Celery worker, two real train steps on the tiny
model, Debian's chromium driven by Playwright. Screenshots go to the
test-artifact directory (`$RLGATE_ARTIFACTS/browser` or `test-artifacts/browser`),
and to docs/img with RLGATE_SCREENSHOTS=1 (see conftest).
"""

from __future__ import annotations

import re

import httpx
import pytest

from tests.browser.rl_run import ADMIN_KEY, _create

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CHARTS = ("reward_mean", "loss", "kl", "entropy", "clip_frac", "staleness_mean", "tokens_per_s")


def submit(page, form: str) -> None:
    """Submit `form` and wait for the page it leads to: a plain form posts and navigates,
    and reading the page before that navigation lands reads the old page (or none)."""
    with page.expect_navigation():
        page.click(f"{form} button[type=submit]")


def _login(page, url: str, key: str = ADMIN_KEY) -> None:
    page.goto(f"{url}/dashboard/")
    assert page.url.endswith("/dashboard/login")  # no session: sent to the login form
    page.fill("input[name=admin_key]", key)
    submit(page, "#login-form")


def chart_points(page, name: str) -> list[int]:
    """Per series of the chart `name`, how many points it draws (read from its uPlot)."""
    return page.evaluate(
        "n => window.rlCharts[n].data.slice(1).map(s => s.filter(v => v !== null).length)", name
    )


def test_login_run_charts_episode_tokens_pause_resume(browser, real_run, shoot) -> None:
    run_id = real_run.run["run_id"]
    page = browser.new_page(viewport={"width": 1360, "height": 1000})
    _login(page, real_run.url, "not-the-key")
    assert "wrong admin key" in page.inner_text(".error")
    page.fill("input[name=admin_key]", ADMIN_KEY)
    submit(page, "#login-form")
    page.wait_for_selector(f"tr[data-run='{run_id}']")
    # reward sparkline from the two finished steps, drawn by uPlot
    spark = page.wait_for_selector(f"tr[data-run='{run_id}'] .spark canvas", state="attached")
    assert spark is not None
    assert page.get_attribute(f"tr[data-run='{run_id}'] .spark", "data-points") == "2"
    shoot(page, "runs", docs=False)

    page.click(f"tr[data-run='{run_id}'] a")
    page.wait_for_selector("#charts[data-drawn='2']", state="attached")
    for name in CHARTS:
        page.wait_for_selector(f"figure[data-series={name}] .uplot canvas", state="attached")
        assert chart_points(page, name) == [2], name
    # the x values are the two steps; the legend names the step's version
    assert page.evaluate("window.rlCharts.reward_mean.data[0]") == [0, 1]
    # hot-swap history: the base model and the two trained versions, v2 serving
    rows = page.locator("#versions tbody tr")
    assert rows.count() == 3
    assert "serving" in rows.first.inner_text() and "v2" in rows.first.inner_text()
    shoot(page, "run")
    page.check("input[name=xaxis][value=time]")
    page.wait_for_function("window.rlCharts.loss.scales.x.time === true")
    assert chart_points(page, "loss") == [2]
    assert "x=time" in page.url  # the view is in the address

    # an episode whose second turn followed a tool call, trained at step 0
    page.click("#episodes a:text-is('s0-g0-e1')")
    page.wait_for_selector(".tokens.output .tok")
    assert "add" in page.inner_text(".messages")  # the tool call is shown
    tokens = page.locator(".tokens.output .tok")
    assert tokens.count() > 0
    for i in range(tokens.count()):
        tok = tokens.nth(i)
        logprob = float(tok.get_attribute("data-logprob"))
        assert logprob <= 0.0
        hue = int(re.search(r"hsl\((\d+),", tok.get_attribute("style")).group(1))
        assert hue == round(120 * min(1.0, 2.718281828459045**logprob))  # colour from logprob
        assert f"logprob {logprob:.4f}" in tok.get_attribute("title")
        assert "trained" in (tok.get_attribute("class") or "").split()
    # the prompt's tokens are masked (no loss), the rendered colour is not the default
    assert page.locator(".prompt-tokens .tok.masked").count() > 0
    shoot(page, "episode")

    # pause and resume from the UI; the admin API sees each change
    page.goto(f"{real_run.url}/dashboard/runs/{run_id}")
    with real_run.admin() as admin:
        page.click("#btn-pause")
        page.wait_for_selector("#run-status:text-is('paused')")
        assert admin.get(f"/admin/v1/runs/{run_id}").json()["status"] == "paused"
        page.click("#btn-resume")
        page.wait_for_selector("#run-status:text-is('active')")
        assert admin.get(f"/admin/v1/runs/{run_id}").json()["status"] == "active"
    page.close()


def test_create_run_from_the_ui(browser, real_run) -> None:
    page = browser.new_page()
    _login(page, real_run.url)
    page.fill("#create-run input[name=name]", "ui-made")
    page.fill("#create-run input[name=config]", '{"group_size": 3}')
    submit(page, "#create-run")
    key = page.inner_text("#new-key")  # shown once
    with real_run.admin() as admin:
        made = [r for r in admin.get("/admin/v1/runs").json() if r["name"] == "ui-made"]
        assert len(made) == 1 and made[0]["config"]["group_size"] == 3
        keys = admin.get(f"/admin/v1/runs/{made[0]['run_id']}/keys").json()
    assert key.startswith(keys[0]["prefix"])
    # a bad config is refused with the service's message, and creates nothing
    page.goto(f"{real_run.url}/dashboard/")
    page.fill("#create-run input[name=name]", "ui-bad")
    page.fill("#create-run input[name=config]", '{"group_size": 1}')
    submit(page, "#create-run")
    assert "group_size" in page.inner_text(".error")
    with real_run.admin() as admin:
        assert not [r for r in admin.get("/admin/v1/runs").json() if r["name"] == "ui-bad"]
    page.close()


def test_keys_page_create_and_revoke(browser, real_run) -> None:
    # a run of its own: its chat call must not add an episode to the shared run's lists
    own = _create(real_run.url, "keys-page", real_run.run["model"])
    run_id = own["run_id"]
    page = browser.new_page()
    _login(page, real_run.url)
    page.goto(f"{real_run.url}/dashboard/runs/{run_id}/keys")
    page.click("text=New key")
    key = page.inner_text("#new-key")
    chat = {"model": "keys-page", "messages": [{"role": "user", "content": "hi"}]}
    http = httpx.Client(base_url=real_run.url, timeout=60)
    auth = {"Authorization": f"Bearer {key}"}
    assert http.post("/v1/chat/completions", json=chat | {"max_tokens": 2}, headers=auth).is_success
    row = page.locator("#keys tbody tr").last
    row.locator("button:text-is('Revoke')").click()
    page.wait_for_load_state()
    assert page.locator("#keys tbody tr").last.locator("button").count() == 0
    r = http.post("/v1/chat/completions", json=chat | {"max_tokens": 2}, headers=auth)
    assert r.status_code == 401  # revoked at once
    page.close()


def _http_session(url: str) -> tuple[httpx.Client, str]:
    """Log in over plain HTTP; returns the client (holding the cookie) and its CSRF token."""
    http = httpx.Client(base_url=url, timeout=60, follow_redirects=False)
    form = http.get("/dashboard/login").text
    token = re.search(r'name="csrf_token" value="([^"]+)"', form).group(1)
    r = http.post("/dashboard/login", data={"csrf_token": token, "admin_key": ADMIN_KEY})
    assert r.status_code == 303, r.text
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
    page = http.get("/dashboard/").text
    return http, re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)


def test_every_dashboard_post_needs_the_session_csrf_token(real_run) -> None:
    run_id = real_run.run["run_id"]
    http, csrf = _http_session(real_run.url)
    status = lambda: real_run.admin().get(f"/admin/v1/runs/{run_id}").json()["status"]  # noqa: E731
    posts = [
        f"/dashboard/runs/{run_id}/pause",
        f"/dashboard/runs/{run_id}/stop",
        "/dashboard/runs",
        f"/dashboard/runs/{run_id}/keys",
        "/dashboard/logout",
    ]
    keys_before = len(real_run.admin().get(f"/admin/v1/runs/{run_id}/keys").json())
    for path in posts:
        for data in ({}, {"csrf_token": "forged"}):
            r = http.post(path, data=data | {"name": "x", "model": "tiny"})
            assert r.status_code == 403, (path, r.status_code)
            assert r.json()["error"]["code"] == "csrf_failed"
        r = http.post(path, data={}, headers={"X-CSRF-Token": csrf + "x"})
        assert r.status_code == 403
    assert status() == "active"
    assert len(real_run.admin().get(f"/admin/v1/runs/{run_id}/keys").json()) == keys_before
    # the login form itself needs its double-submit token
    fresh = httpx.Client(base_url=real_run.url, timeout=60)
    assert fresh.post("/dashboard/login", data={"admin_key": ADMIN_KEY}).status_code == 403
    # a forged session cookie is no session
    fresh.cookies.set("rlgate_session", "e30.deadbeef", path="/dashboard")
    assert fresh.get("/dashboard/api/runs").status_code == 401
    for path in (f"/dashboard/compare?run={run_id}", f"/dashboard/runs/{run_id}/groups/s0-g0"):
        r = fresh.get(path, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/dashboard/login", path
    # the chart library is served from the package itself, with its licence
    for path in ("uPlot.iife.min.js", "uPlot.min.css", "LICENSE"):
        assert fresh.get(f"/dashboard/static/vendor/uplot/{path}").status_code == 200
    # with the token, the same POST works
    r = http.post(f"/dashboard/runs/{run_id}/pause", data={"csrf_token": csrf})
    assert r.status_code == 303 and status() == "paused"
    r = http.post(f"/dashboard/runs/{run_id}/resume", headers={"X-CSRF-Token": csrf})
    assert r.status_code == 303 and status() == "active"
    # log out: the cookie is cleared and the pages send the browser back to the login form
    r = http.post("/dashboard/logout", data={"csrf_token": csrf})
    assert r.status_code == 303 and r.headers["location"] == "/dashboard/login"
    assert "rlgate_session=" in r.headers["set-cookie"] and "Max-Age=0" in r.headers["set-cookie"]
    assert http.get("/dashboard/api/runs").status_code == 401
