"""Episode filters (group, sampled length, template drift) and the group view, on SQLite and
PostgreSQL.

A real gateway per store, agents over HTTP, rewards over REST. Template drift
is set on one stored turn by hand (the tiny model's template never drifts), so
the filter has something to find.
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest

pytestmark = pytest.mark.integration

QUESTION = [{"role": "user", "content": "what is one plus two?"}]
REWARDS = {"e0": 0.0, "e1": 0.5, "e2": 1.0}


@dataclass
class Store:
    admin: httpx.Client
    run: dict
    set_drift: Callable[[str], None]  # completion id -> drift on


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    if request.param == "sqlite":
        server = request.getfixturevalue("gateway_server")

        def set_drift(completion_id: str) -> None:
            with sqlite3.connect(server.db_path, timeout=30) as conn:
                conn.execute("UPDATE completions SET drift = 1 WHERE id = ?", (completion_id,))

    else:
        pg = request.getfixturevalue("pg")
        server = pg.server

        def set_drift(completion_id: str) -> None:
            pg.conn.execute("UPDATE completions SET drift = true WHERE id = %s", (completion_id,))

    # groups_per_step 2: one complete group never makes a step, so every member stays pending
    run = server.create_run(
        name="views", config={"group_size": 3, "groups_per_step": 2, "micro_batch_size": 6}
    )
    with httpx.Client(base_url=server.url, headers=server.admin_headers(), timeout=60) as admin:
        yield Store(admin, run, set_drift)


@pytest.fixture(scope="module")
def group(store: Store) -> dict[str, dict]:
    """Episodes e0..e2 of group g1 (and one of g2), rewarded; e1's turn drifted."""
    agent = httpx.Client(
        base_url=store.admin.base_url,
        headers={"Authorization": f"Bearer {store.run['api_key']}"},
        timeout=120,
    )
    made = {}
    for i, (ep, reward) in enumerate({**REWARDS, "x0": 0.0}.items()):
        gid = "g2" if ep == "x0" else "g1"
        r = agent.post(
            f"/groups/{gid}/episodes/{ep}/v1/chat/completions",
            json={"model": store.run["name"], "messages": QUESTION, "max_tokens": 2 + 3 * i},
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert agent.post("/v1/rewards", json={"episode_id": ep, "reward": reward}).is_success
        made[ep] = {"id": body["id"], "tokens": body["usage"]["completion_tokens"]}
    store.set_drift(made["e1"]["id"])
    return made


def _ids(store: Store, **params) -> set[str]:
    r = store.admin.get(f"/admin/v1/runs/{store.run['run_id']}/episodes", params=params)
    assert r.status_code == 200, r.text
    return {e["episode_id"] for e in r.json()["data"]}


def test_filters_by_group_length_and_drift(store: Store, group: dict[str, dict]) -> None:
    tokens = {ep: m["tokens"] for ep, m in group.items()}
    page = store.admin.get(f"/admin/v1/runs/{store.run['run_id']}/episodes").json()["data"]
    shown = {e["episode_id"]: (e["sampled_tokens"], e["drift"]) for e in page}
    assert shown == {ep: (n, ep == "e1") for ep, n in tokens.items()}

    assert _ids(store, group_id="g1") == set(REWARDS)
    assert _ids(store, group_id="g2") == {"x0"}
    assert _ids(store, group_id="nope") == set()
    cut = sorted(tokens.values())[2]  # the third shortest: keeps two, drops two (or more)
    assert _ids(store, length_min=cut) == {ep for ep, n in tokens.items() if n >= cut}
    assert _ids(store, length_max=cut - 1) == {ep for ep, n in tokens.items() if n < cut}
    assert _ids(store, length_min=cut, length_max=cut) == {
        ep for ep, n in tokens.items() if n == cut
    }
    assert _ids(store, drift="true") == {"e1"}
    assert _ids(store, drift="false") == {"e0", "e2", "x0"}
    assert _ids(store, drift="true", group_id="g2") == set()
    assert _ids(store, reward_min=0.5, group_id="g1", drift="false") == {"e2"}


@pytest.mark.parametrize(
    "bad",
    [
        {"length_min": -1},
        {"length_max": "long"},
        {"length_min": 5, "length_max": 4},
        {"length_min": 2**40},
        {"drift": "maybe"},
        {"group_id": ""},
        {"group_id": "g" * 101},
    ],
)
def test_bad_filters_are_400(store: Store, bad: dict) -> None:
    r = store.admin.get(f"/admin/v1/runs/{store.run['run_id']}/episodes", params=bad)
    assert r.status_code == 400, (bad, r.status_code, r.text)
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_group_view_has_each_members_advantage(store: Store, group: dict[str, dict]) -> None:
    rid = store.run["run_id"]
    view = store.admin.get(f"/admin/v1/runs/{rid}/groups/g1").json()
    assert (view["advantage_estimator"], view["reward_policy"]) == ("grpo", "broadcast")
    members = view["episodes"]
    assert [m["episode_id"] for m in members] == ["e0", "e1", "e2"]  # oldest first
    mean = sum(REWARDS.values()) / 3
    std = math.sqrt(sum((r - mean) ** 2 for r in REWARDS.values()) / 3)  # population std
    for m in members:
        want = (REWARDS[m["episode_id"]] - mean) / (std + 1e-6)
        assert m["episode_return"] == REWARDS[m["episode_id"]]
        assert m["advantage"] == pytest.approx(want, abs=1e-9)
        assert m["peers"] == 3
        (turn,) = m["turns_detail"]  # one turn each; broadcast: the turn gets the episode's
        assert turn["completion_id"] == group[m["episode_id"]]["id"]
        assert turn["output_tokens"] == group[m["episode_id"]]["tokens"] == m["sampled_tokens"]
        assert turn["advantage"] == pytest.approx(want, abs=1e-9)
    assert members[1]["drift"] is True
    assert members[0]["advantage"] < 0 < members[2]["advantage"]
    assert store.admin.get(f"/admin/v1/runs/{rid}/groups/nope").status_code == 404
    assert store.admin.get("/admin/v1/runs/run_nope/groups/g1").status_code == 404
