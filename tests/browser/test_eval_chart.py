"""Must-show: the run page charts held-out reward by version beside the training reward, and
the compare view overlays the held-out curves of the compared runs.

Real runs of the tiny model on the browser tests' stack (uvicorn gateway, Celery worker):
evaluation episodes through the gateway's `/eval` calls on the official `openai` client, at
version 0, then a real train step, more at version 1, another step, more at version 2, and
one episode whose first turn was sampled before the first swap and its second after (it
spans it); rewards over `/v1/rewards` (episode rewards, per-turn rewards, a revised one, an
unscored episode). The chart's means are read from its uPlot instance
(`window.rlCharts.evals`) and compared with the admin API's `/evals` rows and with the
figures recomputed here from the posted rewards.
"""

from __future__ import annotations

import math
import os
import statistics

import httpx
import openai
import pytest

from tests.browser.rl_run import RunFixture, _create, _wave, wait_version
from tests.browser.test_dashboard import _login

pytestmark = [pytest.mark.integration, pytest.mark.slow]

QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]


def _eval_turn(fx: RunFixture, run: dict, episode: str, turn: int = 0) -> str:
    """One evaluation call in `episode` (its `turn`-th); the completion's id."""
    client = openai.OpenAI(base_url=f"{fx.url}/eval/episodes/{episode}/v1", api_key=run["api_key"])
    messages = list(QUESTION)
    if turn:
        messages += [
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "Are you sure?"},
        ]
    resp = client.chat.completions.create(model=run["name"], messages=messages, max_tokens=6)
    return resp.id


def _reward(fx: RunFixture, run: dict, **body: object) -> None:
    r = httpx.post(
        f"{fx.url}/v1/rewards",
        json=body,
        headers={"Authorization": f"Bearer {run['api_key']}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text


def _expected(scores: list[float]) -> dict:
    n = len(scores)
    stderr = statistics.stdev(scores) / math.sqrt(n) if n > 1 else None
    return {"episodes": n, "mean_reward": statistics.fmean(scores), "stderr": stderr}


def _drawn(page) -> list[dict]:
    """Per series of the held-out chart: its version -> drawn (mean, stderr, episodes)."""
    return page.evaluate(
        """() => {
          const u = window.rlCharts.evals;
          return u.data.slice(1).map((ys, i) => Object.fromEntries(u.data[0]
            .map((v, j) => [v, ys[j], u.rl.rows[i][j]])
            .filter(([, y]) => y !== null)
            .map(([v, y, d]) => [v, {mean_reward: y, stderr: d.stderr, episodes: d.episodes}])));
        }"""
    )


def _as_drawn(rows: list[dict]) -> dict:
    """Admin API rows keyed as `_drawn` keys them (JSON object keys are strings)."""
    return {
        str(r["version"]): {k: r[k] for k in ("mean_reward", "stderr", "episodes")} for r in rows
    }


@pytest.fixture(scope="module")
def eval_runs(real_run: RunFixture) -> tuple[dict, dict, dict]:
    """(run, other, expected): `run` evaluated at versions 0, 1 and 2 around two train steps,
    `other` at version 0 only; `expected` the figures recomputed from the rewards posted."""
    model = os.environ.get("RLGATE_BROWSER_MODEL", "tiny")
    run = _create(real_run.url, "held-out-run", model)
    other = _create(real_run.url, "held-out-other", model)
    ids = {}
    # version 0: episode rewards, one revised, one episode scored by its turns, one unscored
    for i, reward in enumerate((0.2, 0.6, 0.0)):
        _eval_turn(real_run, run, f"v0-{i}")
        _reward(real_run, run, episode_id=f"v0-{i}", reward=reward)
    _reward(real_run, run, episode_id="v0-2", reward=1.0)  # revised: 1.0 counts
    for turn in range(2):
        _reward(
            real_run, run, completion_id=_eval_turn(real_run, run, "v0-turns", turn), reward=0.25
        )
    _eval_turn(real_run, run, "v0-unscored")
    ids["span"] = _eval_turn(real_run, run, "span")  # its first turn by version 0
    for i, reward in enumerate((0.1, 0.4)):
        _eval_turn(real_run, other, f"o-{i}")
        _reward(real_run, other, episode_id=f"o-{i}", reward=reward)

    _wave(real_run.url, run, 0, [])  # one real train step: version 1
    wait_version(real_run, 1, run=run)

    for i, reward in enumerate((0.9, 0.5)):
        _eval_turn(real_run, run, f"v1-{i}")
        _reward(real_run, run, episode_id=f"v1-{i}", reward=reward)
    _eval_turn(real_run, run, "span", 1)  # its second turn by version 1
    _reward(real_run, run, episode_id="span", reward=0.7)

    _wave(real_run.url, run, 1, [])  # a second step: version 2
    wait_version(real_run, 2, run=run)
    for i, reward in enumerate((1.0, 0.8, 0.9)):
        _eval_turn(real_run, run, f"v2-{i}")
        _reward(real_run, run, episode_id=f"v2-{i}", reward=reward)
    expected = {
        "run": {
            0: _expected([0.2, 0.6, 1.0, 0.5]),
            1: _expected([0.9, 0.5]),
            2: _expected([1.0, 0.8, 0.9]),
        },
        "spanning": _expected([0.7]),
        "other": {0: _expected([0.1, 0.4])},
    }
    return run, other, expected


def test_empty_state_before_any_evaluation(browser, real_run) -> None:
    """The fixture's own run has no evaluation episode: the box says so, nothing is drawn."""
    page = browser.new_page(viewport={"width": 1360, "height": 1000})
    _login(page, real_run.url)
    page.goto(f"{real_run.url}/dashboard/runs/{real_run.run['run_id']}")
    page.wait_for_selector("#evals[data-points='0']", state="attached")
    assert "No held-out evaluation yet" in page.inner_text("#evals .plot")
    assert page.evaluate("window.rlCharts.evals === undefined")
    assert page.is_hidden("#evals .eval-note")
    page.close()


def test_run_page_charts_held_out_reward_by_version(browser, real_run, eval_runs, shoot) -> None:
    run, _other, expected = eval_runs
    admin = real_run.admin().get(f"/admin/v1/runs/{run['run_id']}/evals")
    assert admin.status_code == 200, admin.text
    figures = admin.json()
    page = browser.new_page(viewport={"width": 1360, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    _login(page, real_run.url)
    page.goto(f"{real_run.url}/dashboard/runs/{run['run_id']}")
    page.wait_for_selector("#evals[data-points='3']", state="attached")

    drawn = _drawn(page)
    assert drawn == [_as_drawn(figures["data"])]  # what is drawn is what the admin API says
    want = {str(v): e for v, e in expected["run"].items()}  # and what the rewards give
    assert drawn[0].keys() == want.keys()
    for v, fig in drawn[0].items():
        assert fig["episodes"] == want[v]["episodes"], v
        assert fig["mean_reward"] == pytest.approx(want[v]["mean_reward"]), v
        assert fig["stderr"] == pytest.approx(want[v]["stderr"]), v
    assert page.evaluate("window.rlCharts.evals.data[0]") == [0, 1, 2]  # x: versions

    # the swap-spanning episode is reported apart, in words, with the admin API's figures
    spanning = figures["spanning"]
    assert spanning["episodes"] == expected["spanning"]["episodes"] == 1
    assert spanning["mean_reward"] == pytest.approx(expected["spanning"]["mean_reward"])
    note = page.inner_text("#evals .eval-note")
    assert "1 episode(s) spanned a swap" in note and "0.7000 (n=1)" in note

    # beside the training reward: same row of the grid, next to it
    reward = page.locator("figure[data-series=reward_mean]").bounding_box()
    held = page.locator("#evals").bounding_box()
    assert held["y"] == pytest.approx(reward["y"], abs=1) and held["x"] > reward["x"]

    # hover version 0: the legend shows its mean, standard error and episode count
    box = page.locator("#evals .u-over").bounding_box()
    x0 = page.evaluate("window.rlCharts.evals.valToPos(0, 'x')")
    page.mouse.move(box["x"] + x0, box["y"] + box["height"] / 2)
    values = page.locator("#evals .u-legend .u-series .u-value")
    page.wait_for_function(
        "() => document.querySelector('#evals .u-legend .u-series .u-value').textContent === 'v0'"
    )
    v0 = want["0"]
    assert values.nth(1).inner_text() == (
        f"{v0['mean_reward']:.4f} ± {v0['stderr']:.4f} (n={v0['episodes']})"
    )
    shoot(page, "evals")
    assert errors == []
    page.close()


def test_compare_overlays_held_out_curves(browser, real_run, eval_runs) -> None:
    run, other, expected = eval_runs
    with real_run.admin() as admin:
        figures = [admin.get(f"/admin/v1/runs/{r['run_id']}/evals").json() for r in (run, other)]
    page = browser.new_page(viewport={"width": 1360, "height": 1100})
    _login(page, real_run.url)
    page.goto(f"{real_run.url}/dashboard/compare?run={run['run_id']}&run={other['run_id']}")
    page.wait_for_selector("#evals[data-points='4']", state="attached")
    labels = page.evaluate("window.rlCharts.evals.series.slice(1).map(s => s.label)")
    assert labels == [run["name"], other["name"]]
    # one curve per run, each its own figures; `other` has no version 1 or 2 (gaps, not zeros)
    assert _drawn(page) == [_as_drawn(f["data"]) for f in figures]
    assert page.evaluate("window.rlCharts.evals.data[2]") == [
        pytest.approx(expected["other"][0]["mean_reward"]),
        None,
        None,
    ]
    assert page.inner_text("#evals .eval-note").startswith(f"{run['name']}: 1 episode(s)")
    page.close()
