"""Admission and run status through a real gateway: every agent endpoint is admitted in one place.

A run with room for one unconsumed episode and `admission_wait_s: 0`
answers a second new conversation at once with 429 and `Retry-After: 60`,
whichever endpoint starts it (chat, streamed chat, text completions,
Responses), before any stream starts; the status endpoint and the reward
answer say so.
"""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.integration

MSGS = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def full(gateway_server) -> tuple[dict, httpx.Client, dict]:
    """A run whose one place is taken by episode `first` (group `g`), and an HTTP client."""
    run = gateway_server.create_run(
        name="admission-full",
        config={
            "max_pending_episodes": 1,
            "admission_wait_s": 0,
            "group_size": 2,
            "groups_per_step": 1,
            "micro_batch_size": 2,
        },
    )
    http = httpx.Client(
        base_url=gateway_server.url,
        headers={"Authorization": f"Bearer {run['api_key']}"},
        timeout=60,
    )
    first = http.post(
        "/groups/g/episodes/first/v1/chat/completions",
        json={"model": run["name"], "messages": MSGS, "max_tokens": 2},
    )
    assert first.status_code == 200, first.text
    return run, http, first.json()


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        ("/v1/chat/completions", {"messages": MSGS}),
        ("/v1/chat/completions", {"messages": MSGS, "stream": True}),
        ("/v1/completions", {"prompt": "once upon"}),
        ("/v1/completions", {"prompt": "once upon", "stream": True}),
        ("/v1/responses", {"input": "hello there"}),
        ("/episodes/new-one/v1/chat/completions", {"messages": MSGS}),
    ],
)
def test_a_new_conversation_over_capacity_gets_429_with_retry_after(full, path, extra) -> None:
    run, http, _ = full
    body = {"model": run["name"], "max_tokens": 2, **extra}
    if path.endswith("responses"):
        body = {"model": run["name"], "max_output_tokens": 2, **extra}
    resp = http.post(path, json=body)
    assert resp.status_code == 429, resp.text
    assert resp.headers["Retry-After"] == "60"
    assert resp.headers["content-type"].startswith("application/json")  # no stream started
    assert resp.json()["error"]["code"] == "admission_capacity"


def test_a_later_turn_of_the_admitted_episode_goes_on(full) -> None:
    run, http, _ = full
    resp = http.post(
        "/groups/g/episodes/first/v1/chat/completions",
        json={
            "model": run["name"],
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2,
        },
    )
    assert resp.status_code == 200, resp.text


def test_the_openai_sdk_sees_a_rate_limit_error_after_its_retries(full, monkeypatch) -> None:
    run, _, _ = full
    waits: list[float] = []
    monkeypatch.setattr("time.sleep", waits.append)  # the SDK's retry sleeps, not taken
    client = openai.OpenAI(base_url=run["base_url"], api_key=run["api_key"])
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model=run["name"], messages=MSGS, max_tokens=2)
    assert waits == [60.0, 60.0]  # two default retries, each honouring Retry-After


def test_status_and_reward_answers_say_where_the_samples_stand(full) -> None:
    run, http, _ = full
    status = http.get("/v1/runs/self").json()
    assert status["object"] == "run.progress" and status["run_id"] == run["run_id"]
    assert status["version"] == 0 and status["status"] == "active"
    assert status["admission"] == {
        "capacity": 1,
        "in_use": 1,
        "group_capacity": None,  # max_pending_episodes overrides the group capacity
        "groups_in_use": 1,
        "held": 0,
    }
    assert status["next_step"] == {
        "step": 0,
        "ready_groups": 0,
        "groups_per_step": 1,
        "in_flight": False,
    }
    ack = http.post("/v1/rewards", json={"episode_id": "first", "reward": 1.0}).json()
    assert ack["episode_status"] == "rewarded"
    progress = ack["progress"]
    assert progress["episode"] == {"id": "first", "state": "waiting", "step": None, "episodes": 1}
    assert progress["group"] == {"id": "g", "state": "waiting", "step": None, "episodes": 1}
    scoped = http.get("/groups/g/episodes/first/v1/runs/self").json()
    assert scoped["episode"]["id"] == "first" and scoped["group"]["id"] == "g"
    missing = http.get("/v1/runs/self", params={"group_id": "nope"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "group_id"
