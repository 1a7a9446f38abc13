"""The dashboard of a run with policies (docs/policies.md): its policies table, and one
episode's turns of every policy in order, each marked and coloured by its policy."""

from __future__ import annotations

import openai
import pytest

from tests.browser.test_dashboard import _login

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_an_episode_of_two_policies_shows_each_turn_by_policy(browser, real_run) -> None:
    with real_run.admin() as admin:
        config = {"lora_rank": 2, "policies": {"planner": {}, "coder": {}}}
        body = {"name": "team-ui", "model": "tiny", "config": config}
        r = admin.post("/admin/v1/runs", json=body)
        assert r.status_code == 201, r.text
        run = r.json()
        children = {
            c["policy"]: c["run_id"]
            for c in admin.get("/admin/v1/runs").json()
            if c["parent_id"] == run["run_id"]
        }
    agent = openai.OpenAI(
        base_url=f"{real_run.url}/episodes/ui-1/v1", api_key=run["api_key"], max_retries=0
    )
    ids = [
        agent.chat.completions.create(
            model=f"team-ui/{policy}",
            messages=[{"role": "user", "content": f"{policy}, your turn"}],
            max_tokens=4,
        ).id
        for policy in ("planner", "coder")
    ]
    page = browser.new_page(viewport={"width": 1360, "height": 1000})
    _login(page, real_run.url)
    page.goto(f"{real_run.url}/dashboard/runs/{run['run_id']}")
    rows = page.eval_on_selector_all("#policies tbody tr", "rs => rs.map(r => r.dataset.policy)")
    assert rows == ["planner", "coder"]

    page.goto(f"{real_run.url}/dashboard/runs/{run['run_id']}/episodes/ui-1")
    turns = page.eval_on_selector_all(
        "article.turn", "ts => ts.map(t => [t.dataset.policy, t.className, t.innerText])"
    )
    assert [t[0] for t in turns] == ["planner", "coder"]
    assert "pol-0" in turns[0][1] and "pol-1" in turns[1][1]
    assert ids[0] in turns[0][2] and ids[1] in turns[1][2]
    colours = page.eval_on_selector_all(
        "article.turn", "ts => ts.map(t => getComputedStyle(t).borderLeftColor)"
    )
    assert colours[0] != colours[1]
    # one policy's run shows its own turn only
    page.goto(f"{real_run.url}/dashboard/runs/{children['coder']}/episodes/ui-1")
    assert page.eval_on_selector_all("article.turn", "ts => ts.length") == 1
    page.close()
