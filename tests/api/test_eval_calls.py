"""Evaluation calls through a real gateway: every agent endpoint under `/eval`, held out.

The run below has room for one unconsumed training episode and refuses a second
at once (`admission_wait_s: 0`). Evaluation calls on every endpoint and path
form are still answered, are stored as `eval` episodes that nothing of the
training path counts, link only among themselves, and take rewards that never
change their status. A pin (`X-Rlgate-Version`) outside `/eval`, malformed or
naming a version the run does not keep is a 400 in the endpoint's error shape.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

pytestmark = pytest.mark.integration

MSGS = [{"role": "user", "content": "hello there"}]
FAMILY_BODIES = [
    ("/v1/chat/completions", {"messages": MSGS}),
    ("/v1/chat/completions", {"messages": MSGS, "stream": True}),
    ("/v1/completions", {"prompt": "once upon"}),
    ("/v1/completions", {"prompt": "once upon", "stream": True}),
    ("/v1/responses", {"input": "hello there"}),
    ("/v1/responses", {"input": "hello there", "stream": True}),
    ("/v1/messages", {"messages": MSGS}),
    ("/v1/messages", {"messages": MSGS, "stream": True}),
]


@pytest.fixture(scope="module")
def full(gateway_server) -> tuple[dict, httpx.Client, httpx.Client]:
    """A run whose one training place is taken, its agent client and an admin client."""
    run = gateway_server.create_run(
        name="eval-full",
        config={"max_pending_episodes": 1, "admission_wait_s": 0},
    )
    http = httpx.Client(
        base_url=gateway_server.url,
        headers={"Authorization": f"Bearer {run['api_key']}"},
        timeout=60,
    )
    admin = httpx.Client(
        base_url=gateway_server.url, headers=gateway_server.admin_headers(), timeout=60
    )
    first = http.post(
        "/episodes/train-1/v1/chat/completions",
        json={"model": run["name"], "messages": MSGS, "max_tokens": 2},
    )
    assert first.status_code == 200, first.text
    over = http.post(
        "/v1/chat/completions", json={"model": run["name"], "messages": MSGS, "max_tokens": 2}
    )
    assert over.status_code == 429, over.text  # the training side is full
    return run, http, admin


def _status(admin: httpx.Client, run: dict, episode_id: str) -> str:
    r = admin.get(f"/admin/v1/runs/{run['run_id']}/episodes/{episode_id}")
    assert r.status_code == 200, r.text
    return r.json()["status"]


@pytest.mark.parametrize("prefix", ["/eval", "/eval/episodes/E", "/eval/groups/g/episodes/E"])
@pytest.mark.parametrize(("path", "extra"), FAMILY_BODIES)
def test_every_endpoint_and_path_form_serves_evaluation_calls_past_admission(
    full, prefix, path, extra, request
) -> None:
    run, http, admin = full
    prefix = prefix.replace("E", f"ev-{request.node.callspec.id}"[:90].replace("/", "_"))
    body = {"model": run["name"], "max_tokens": 2, **extra}
    r = http.post(prefix + path, json=body)
    assert r.status_code == 200, r.text
    episode_id = r.headers["x-rlgate-episode-id"]
    if "/episodes/" in prefix:
        assert episode_id == prefix.rsplit("/", 1)[1]
    assert _status(admin, run, episode_id) == "eval"


def test_evaluation_episodes_are_counted_nowhere_in_the_training_path(full) -> None:
    run, http, admin = full
    before = admin.get(f"/admin/v1/runs/{run['run_id']}").json()
    for i in range(3):
        r = http.post(
            "/eval/v1/chat/completions",
            json={"model": run["name"], "messages": [{"role": "user", "content": f"q{i}"}],
                  "max_tokens": 2},
        )  # fmt: skip
        assert r.status_code == 200, r.text
    after = admin.get(f"/admin/v1/runs/{run['run_id']}").json()
    assert after["counters"] == before["counters"]
    progress = http.get("/v1/runs/self")
    assert progress.status_code == 200, progress.text
    assert progress.json()["admission"]["in_use"] == 1  # the one training episode only


def test_a_conversation_links_within_its_split_only(full) -> None:
    run, http, _ = full
    turn = {"model": run["name"], "messages": [{"role": "user", "content": "count"}],
            "max_tokens": 3}  # fmt: skip
    first = http.post("/eval/v1/chat/completions", json=turn)
    assert first.status_code == 200, first.text
    answer = first.json()["choices"][0]["message"]
    history = [*turn["messages"], {"role": "assistant", "content": answer["content"]},
               {"role": "user", "content": "again"}]  # fmt: skip
    second = http.post("/eval/v1/chat/completions", json={**turn, "messages": history})
    assert second.status_code == 200, second.text
    ep = first.headers["x-rlgate-episode-id"]
    assert second.headers["x-rlgate-episode-id"] == ep  # linked by prefix, within evaluation
    # The same history sent for training does not join the evaluation episode: it would be
    # a new training conversation, which this full run refuses (429), never a link.
    train = http.post("/v1/chat/completions", json={**turn, "messages": history})
    assert train.status_code == 429, train.text


def test_an_episode_id_used_by_both_splits_is_a_409(full) -> None:
    run, http, _ = full
    body = {"model": run["name"], "messages": MSGS, "max_tokens": 2}
    r = http.post("/eval/episodes/train-1/v1/chat/completions", json=body)
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == "episode_split_conflict"
    ok = http.post("/eval/episodes/held-1/v1/chat/completions", json=body)
    assert ok.status_code == 200, ok.text
    r = http.post("/episodes/held-1/v1/chat/completions", json=body)
    assert r.status_code == 409, r.text
    r = http.post(
        "/v1/messages", json=body, headers={"X-Episode-Id": "held-1", "x-api-key": run["api_key"]}
    )
    assert r.status_code == 409, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"]  # Anthropic's shape


def test_rewards_score_evaluation_episodes_without_moving_them(full) -> None:
    run, http, admin = full
    body = {"model": run["name"], "messages": MSGS, "max_tokens": 2}
    r = http.post("/eval/episodes/scored/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    before = admin.get(f"/admin/v1/runs/{run['run_id']}").json()["counters"]
    ack = http.post("/v1/rewards", json={"episode_id": "scored", "reward": 0.25})
    assert ack.status_code == 200, ack.text
    assert ack.json()["episode_status"] == "eval"
    assert ack.json()["progress"]["episode"]["state"] == "eval"
    again = http.post("/v1/rewards", json={"episode_id": "scored", "reward": 0.75})
    assert again.status_code == 200, again.text
    detail = admin.get(f"/admin/v1/runs/{run['run_id']}/episodes/scored").json()
    assert detail["status"] == "eval" and detail["reward"] == 0.75  # a later post revises it
    per_turn = http.post("/v1/rewards", json={"completion_id": r.json()["id"], "reward": 1.0})
    assert per_turn.status_code == 200, per_turn.text
    assert admin.get(f"/admin/v1/runs/{run['run_id']}").json()["counters"] == before


def test_version_pins(full) -> None:
    run, http, _ = full
    body = {"model": run["name"], "messages": MSGS, "max_tokens": 2}
    r = http.post("/v1/chat/completions", json=body, headers={"X-Rlgate-Version": "0"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "version_pin_not_evaluation"
    r = http.post("/eval/v1/chat/completions", json=body, headers={"X-Rlgate-Version": "v1"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_version_pin", r.text
    r = http.post("/eval/v1/chat/completions", json=body, headers={"X-Rlgate-Version": "7"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "version_not_kept" and "kept versions: 0" in err["message"]
    # The current version needs no second copy: pinning it is the same as not pinning.
    r = http.post("/eval/v1/chat/completions", json=body, headers={"X-Rlgate-Version": "0"})
    assert r.status_code == 200, r.text
    anthropic = http.post("/eval/v1/messages", json=body, headers={"X-Rlgate-Version": "9"})
    assert anthropic.status_code == 400, anthropic.text
    assert anthropic.json()["type"] == "error"
    assert "kept versions" in anthropic.json()["error"]["message"]


def test_the_openai_client_needs_only_another_base_url(full, gateway_server) -> None:
    run, _, admin = full
    client = openai.OpenAI(base_url=gateway_server.url + "/eval/v1", api_key=run["api_key"])
    out = client.chat.completions.with_raw_response.create(
        model=run["name"], messages=MSGS, max_tokens=2
    )
    episode_id = out.headers["x-rlgate-episode-id"]
    assert out.parse().choices[0].message.content is not None
    assert _status(admin, run, episode_id) == "eval"
    page = admin.get(f"/admin/v1/runs/{run['run_id']}/episodes", params={"status": "eval"})
    assert page.status_code == 200, page.text
    listed = json.dumps(page.json())
    assert episode_id in listed and "train-1" not in listed


def _split_conflicts(http: httpx.Client, name: str, prefix: str) -> None:
    """A held-out episode `prefix`-held, then training calls naming it: each a 409, nothing
    stored; a streamed one ends in an error event instead of its last chunk."""
    body = {"model": name, "messages": MSGS, "max_tokens": 2}
    ok = http.post(f"/eval/episodes/{prefix}-held/v1/chat/completions", json=body)
    assert ok.status_code == 200, ok.text
    refused = http.post(f"/episodes/{prefix}-held/v1/chat/completions", json=body)
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"]["code"] == "episode_split_conflict"
    with http.stream(
        "POST", f"/episodes/{prefix}-held/v1/chat/completions", json={**body, "stream": True}
    ) as stream:
        text = "".join(stream.iter_text())
    assert "episode_split_conflict" in text and "[DONE]" not in text.split("episode_split")[-1]


def test_the_store_refuses_a_training_completion_in_a_held_out_episode(full) -> None:
    run, http, _ = full
    _split_conflicts(http, run["name"], "sqlite")


def test_the_store_refuses_it_on_postgresql_too(pg) -> None:
    _split_conflicts(pg.http, pg.run["name"], "pg")
    held = pg.conn.execute(
        "SELECT e.held_out, count(c.id) FROM episodes e JOIN completions c "
        "ON c.run_id = e.run_id AND c.episode_id = e.id WHERE e.id = 'pg-held' GROUP BY e.held_out"
    ).fetchall()
    assert held == [(True, 1)]  # the refused calls stored nothing
