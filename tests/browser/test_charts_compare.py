"""Must-show: hover shows a value, drag-zoom changes the range, the compare view overlays two
real runs, the episode filters narrow the list, a group shows its advantages.

Two real runs (two train steps each, tiny model) on one real gateway + Celery
worker; Debian's chromium driven by Playwright. The charts are uPlot instances
the page exposes as `window.rlCharts[name]`; the tests read ranges and values
from them, not from pixels.
"""

from __future__ import annotations

import re
import sqlite3

import pytest

from tests.browser.test_dashboard import _login, chart_points, submit

pytestmark = [pytest.mark.integration, pytest.mark.slow]

COMPARED = ("reward_mean", "loss", "kl", "entropy", "staleness_mean", "tokens_per_s")


def _x_range(page, name: str) -> tuple[float, float]:
    r = page.evaluate(
        "n => [window.rlCharts[n].scales.x.min, window.rlCharts[n].scales.x.max]", name
    )
    return r[0], r[1]


def _rows(page, table: str, key: str) -> list[str]:
    """`data-{key}` of each row of `table`, in page order."""
    return page.eval_on_selector_all(
        f"{table} tbody tr[data-{key}]", f"rs => rs.map(r => r.dataset.{key})"
    )


def _drag(page, name: str, start: float, end: float) -> None:
    """Drag across the chart's plot area from `start` to `end` (fractions of its width)."""
    box = page.locator(f"figure[data-series={name}] .u-over").bounding_box()
    y = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + box["width"] * start, y)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * (start + end) / 2, y, steps=4)
    page.mouse.move(box["x"] + box["width"] * end, y, steps=4)
    page.mouse.up()


def test_hover_zoom_smoothing_and_log(browser, real_run) -> None:
    page = browser.new_page(viewport={"width": 1360, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    _login(page, real_run.url)
    page.goto(f"{real_run.url}/dashboard/runs/{real_run.run['run_id']}")
    page.wait_for_selector("#charts[data-drawn='2']", state="attached")
    steps = real_run.admin().get(f"/admin/v1/runs/{real_run.run['run_id']}/metrics").json()
    losses = [p["values"]["loss"] for p in steps["points"]]

    # hover the right edge of the loss chart: the legend shows step 1's loss (and its version)
    box = page.locator("figure[data-series=loss] .u-over").bounding_box()
    page.mouse.move(box["x"] + box["width"] - 2, box["y"] + box["height"] / 2)
    legend = page.locator("figure[data-series=loss] .u-legend")
    page.wait_for_function(
        "() => document.querySelector('figure[data-series=loss] .u-legend .u-series .u-value')"
        ".textContent.includes('step 1')"
    )
    x_text, y_text = legend.locator(".u-series .u-value").all_inner_texts()[:2]
    assert x_text == "step 1 (v2)"
    assert float(y_text) == pytest.approx(losses[1], rel=1e-2, abs=1e-4)  # shown rounded
    # cursors are synced: the reward chart's legend follows
    reward = page.locator("figure[data-series=reward_mean] .u-legend .u-series .u-value")
    assert reward.first.inner_text() == "step 1 (v2)"

    # drag-zoom narrows the x range; double-click restores it
    assert _x_range(page, "loss") == (0, 1)
    _drag(page, "loss", 0.25, 0.75)
    lo, hi = _x_range(page, "loss")
    assert 0 < lo < hi < 1, (lo, hi)
    page.dblclick("figure[data-series=loss] .u-over")
    assert _x_range(page, "loss") == (0, 1)

    # EMA smoothing: the drawn second value moves toward the first, the legend keeps the raw one
    page.fill("input[name=smooth]", "0.5")
    page.dispatch_event("input[name=smooth]", "input")
    page.wait_for_function("location.search.includes('smooth=0.50')")
    drawn = page.evaluate("window.rlCharts.loss.data[1]")
    w = 0.5
    assert drawn[0] == pytest.approx(losses[0])
    want = ((1 - w) * (w * losses[0]) + (1 - w) * losses[1]) / (1 - w**2)  # debiased EMA
    assert drawn[1] == pytest.approx(want, rel=1e-6, abs=1e-9)

    # log scale: on by default for the loss (asinh when a value is <= 0), off for the reward
    distr = page.evaluate("window.rlCharts.loss.scales.y.distr")
    assert distr == (1 if not any(losses) else 3 if min(losses) > 0 else 4)
    assert page.evaluate("window.rlCharts.reward_mean.scales.y.distr") == 1
    page.check("figure[data-series=reward_mean] input.log")
    page.wait_for_function("window.rlCharts.reward_mean.scales.y.distr !== 1")
    assert "reward_mean" in re.search(r"log=([^&]*)", page.url).group(1)
    # the address is the view: a reload keeps smoothing and log choices
    page.reload()
    page.wait_for_selector("#charts[data-drawn='2']", state="attached")
    assert page.input_value("input[name=smooth]") == "0.5"
    assert page.is_checked("figure[data-series=reward_mean] input.log")
    # every chart draws on a log axis too, whatever the signs of its values
    for box in page.locator("figure.chart input.log").all():
        box.check()
    ranges = page.evaluate(
        "Object.entries(window.rlCharts).map(([n, u]) => [n, u.scales.y.min, u.scales.y.max])"
    )
    assert all(lo is not None and hi is not None and lo <= hi for _, lo, hi in ranges), ranges
    assert errors == []
    page.close()


def test_compare_overlays_two_real_runs(browser, real_run, second_run, shoot) -> None:
    first, second = real_run.run, second_run
    page = browser.new_page(viewport={"width": 1360, "height": 1100})
    _login(page, real_run.url)
    page.wait_for_selector(f"tr[data-run='{second['run_id']}']")

    # the runs table sorts by a column and keeps the order in the address
    page.click("th[data-sort=lastReward]")
    page.click("th[data-sort=lastReward]")  # again: descending
    assert "sort=-lastReward" in page.url
    order = _rows(page, "#runs", "run")
    assert order.index(second["run_id"]) < order.index(first["run_id"])  # 1.0 above 0.5
    page.click("th[data-sort=name]")
    names = _rows(page, "#runs", "name")
    assert names == sorted(names)

    # tick both runs and compare: the selection is in the address
    assert page.is_disabled("#compare-btn")
    for run in (first, second):
        page.check(f"tr[data-run='{run['run_id']}'] input[name=run]")
    page.click("#compare-btn")
    page.wait_for_selector("#compare[data-drawn='4']", state="attached")
    assert re.search(rf"run={first['run_id']}&run={second['run_id']}", page.url)
    for name in COMPARED:
        assert chart_points(page, name) == [2, 2], name  # one series per run, both steps
    labels = page.evaluate("window.rlCharts.reward_mean.series.slice(1).map(s => s.label)")
    assert labels == [first["name"], second["name"]]
    rewards = page.evaluate("window.rlCharts.reward_mean.data.slice(1)")
    assert rewards == [[pytest.approx(0.5)] * 2, [pytest.approx(1.0)] * 2]  # each run's own
    shoot(page, "compare")

    # the shared link opens the same view in another tab (same login)
    tab = browser.new_context(storage_state=page.context.storage_state())
    other = tab.new_page()
    other.goto(page.url)
    other.wait_for_selector("#compare[data-drawn='4']", state="attached")
    assert other.evaluate("window.rlCharts.loss.series.length") == 3
    # an unknown run in the link is named, not a server error
    other.goto(f"{real_run.url}/dashboard/compare?run={first['run_id']}&run=run_nope")
    assert "run_nope" in other.inner_text(".error")
    tab.close()
    page.close()


def test_episode_filters_and_group_view(browser, real_run, shoot) -> None:
    run_id = real_run.run["run_id"]
    episodes = real_run.admin().get(f"/admin/v1/runs/{run_id}/episodes").json()["data"]
    tokens = {e["episode_id"]: e["sampled_tokens"] for e in episodes}
    page = browser.new_page(viewport={"width": 1360, "height": 1000})
    _login(page, real_run.url)
    page.goto(f"{real_run.url}/dashboard/runs/{run_id}")

    def listed() -> set[str]:
        return set(_rows(page, "#episodes", "episode"))

    assert listed() == set(real_run.episodes)
    page.fill("#episode-filters input[name=reward_min]", "0.5")
    page.fill("#episode-filters input[name=version]", "1")
    submit(page, "#episode-filters")
    assert listed() == {"s1-g0-e1", "s1-g1-e1"}
    assert "reward_min=0.5" in page.url and "version=1" in page.url
    # by sampled length: the page agrees with the admin API's token counts
    page.goto(f"{real_run.url}/dashboard/runs/{run_id}")
    cut = sorted(tokens.values())[len(tokens) // 2]
    page.fill("#episode-filters input[name=length_min]", str(cut))
    submit(page, "#episode-filters")
    assert listed() == {e for e, n in tokens.items() if n >= cut}
    # drift: the tiny model's template never drifts
    page.select_option("#episode-filters select[name=drift]", "true")
    submit(page, "#episode-filters")
    assert listed() == set()
    page.goto(f"{real_run.url}/dashboard/runs/{run_id}?drift=maybe")
    assert "drift" in page.inner_text(".error")  # a bad value is a message, not a 500

    # a group side by side: rewards 0 and 1 -> advantages -1 and +1 (GRPO, population std)
    page.goto(f"{real_run.url}/dashboard/runs/{run_id}?group_id=s0-g1")
    assert listed() == {"s0-g1-e0", "s0-g1-e1"}
    page.click("#episodes a:text-is('s0-g1')")
    page.wait_for_selector("#group article.member")
    adv = dict(
        page.eval_on_selector_all(
            "#group article.member", "ms => ms.map(m => [m.dataset.episode, m.dataset.advantage])"
        )
    )
    assert float(adv["s0-g1-e0"]) == pytest.approx(-1.0, abs=1e-4)
    assert float(adv["s0-g1-e1"]) == pytest.approx(1.0, abs=1e-4)
    assert "normalised with" in page.inner_text("#group")
    shoot(page, "group")
    page.close()


def test_sink_errors_show_on_the_run_page(browser, real_run) -> None:
    """A step whose metrics sinks failed (the trainer stores `sink_errors`) is flagged."""
    run_id = real_run.run["run_id"]
    page = browser.new_page()
    _login(page, real_run.url)
    page.goto(f"{real_run.url}/dashboard/runs/{run_id}")
    assert page.is_hidden("#sink-errors")
    assert page.locator("#versions .badge.warn").count() == 0
    store = real_run.data_dir / "rlgate.db"
    with sqlite3.connect(store, timeout=30) as db:  # what the trainer stores when sinks fail
        db.execute(
            "UPDATE train_steps SET metrics = json_set(metrics, '$.sink_errors', 2) "
            "WHERE run_id = ? AND step = 1",
            (run_id,),
        )
    try:
        page.reload()
        assert page.is_visible("#sink-errors")
        assert page.inner_text("#sink-errors .count") == "2"
        assert page.inner_text("#versions .badge.warn") == "⚠ 2"
    finally:
        with sqlite3.connect(store, timeout=30) as db:  # the other tests share this run
            db.execute(
                "UPDATE train_steps SET metrics = json_remove(metrics, '$.sink_errors') "
                "WHERE run_id = ? AND step = 1",
                (run_id,),
            )
        page.close()
