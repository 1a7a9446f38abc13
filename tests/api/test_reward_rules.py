"""Reward bounds (422 `reward_out_of_bounds`) and idempotency keys shared by two runs.

A real gateway (SQLite, no worker) and plain HTTP: every rejected post is
checked against the store, which must not change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest

if TYPE_CHECKING:
    from tests.conftest import GatewayServer

pytestmark = pytest.mark.integration

USER = [{"role": "user", "content": "what is one plus two?"}]
WATCHED = ("episodes", "completions", "rewards", "train_steps")
BOUNDS = {"reward_min": -1.0, "reward_max": 1.0}


class Agent:
    """One run's agent key over HTTP."""

    def __init__(self, server: GatewayServer, run: dict) -> None:
        self.server, self.run = server, run
        self.http = httpx.Client(
            base_url=server.url, headers={"Authorization": f"Bearer {run['api_key']}"}, timeout=60
        )

    def chat(self, **headers: str) -> dict:
        body = {"model": self.run["name"], "messages": USER, "max_tokens": 3}
        resp = self.http.post("/v1/chat/completions", json=body, headers=headers)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def reward(self, body: dict | list) -> httpx.Response:
        return self.http.post("/v1/rewards", json=body)


@pytest.fixture(scope="module")
def bounded(gateway_server: GatewayServer) -> Iterator[Agent]:
    # group_size 4 is never reached here: no step changes a status meanwhile
    agent = Agent(gateway_server, gateway_server.create_run("bounded", config=BOUNDS))
    yield agent
    agent.http.close()


@pytest.fixture(scope="module")
def two_runs(gateway_server: GatewayServer) -> Iterator[tuple[Agent, Agent]]:
    a = Agent(gateway_server, gateway_server.create_run("idem-a"))
    b = Agent(gateway_server, gateway_server.create_run("idem-b"))
    yield a, b
    a.http.close()
    b.http.close()


@contextlib.contextmanager
def no_writes(server: GatewayServer) -> Iterator[None]:
    before = {t: server.count(t) for t in WATCHED}
    yield
    assert {t: server.count(t) for t in WATCHED} == before, "a rejected post wrote to the store"


def assert_error(resp: httpx.Response, status: int, **fields: Any) -> dict:
    """Exactly OpenAI's error body, with `fields` among its values."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    for name, value in fields.items():
        assert body["error"][name] == value, body
    return body["error"]


def _reward_of(server: GatewayServer, completion_id: str) -> float | None:
    return server.query("SELECT reward FROM completions WHERE id = ?", (completion_id,))[0][0]


# --- reward bounds ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", [-1.5, 1.0001, 1e300, -1e300])
def test_out_of_bounds_is_422_and_writes_nothing(
    bounded: Agent, gateway_server: GatewayServer, value: float
) -> None:
    c = bounded.chat()
    with no_writes(gateway_server):
        err = assert_error(
            bounded.reward({"completion_id": c["id"], "reward": value}),
            422,
            type="invalid_request_error",
            param="reward",
            code="reward_out_of_bounds",
        )
        assert "[-1.0, 1.0]" in err["message"]
        # an episode-level reward is held to the same bounds
        episode = {"episode_id": c["episode_id"], "reward": value, "idempotency_key": "b-ep"}
        assert_error(bounded.reward(episode), 422, code="reward_out_of_bounds")
    assert _reward_of(gateway_server, c["id"]) is None


def test_the_bounds_themselves_are_accepted(bounded: Agent, gateway_server: GatewayServer) -> None:
    for value in (-1.0, 1.0):
        c = bounded.chat()
        ack = bounded.reward({"completion_id": c["id"], "reward": value})
        assert ack.status_code == 200, ack.text
        assert _reward_of(gateway_server, c["id"]) == value


def test_one_item_out_of_bounds_rejects_the_whole_batch(
    bounded: Agent, gateway_server: GatewayServer
) -> None:
    ok, bad = bounded.chat(), bounded.chat()
    batch = [
        {"completion_id": ok["id"], "reward": 0.5, "idempotency_key": "batch-ok"},
        {"completion_id": bad["id"], "reward": 7.0},
    ]
    with no_writes(gateway_server):
        assert_error(bounded.reward(batch), 422, param="reward", code="reward_out_of_bounds")
    # the key of the rejected batch was not used up: the good item alone goes through
    ack = bounded.reward(batch[0])
    assert ack.status_code == 200 and ack.json()["duplicate"] is False, ack.text


def test_bounds_changed_live_apply_to_the_next_post(
    bounded: Agent, gateway_server: GatewayServer
) -> None:
    rid = bounded.run["run_id"]
    admin = httpx.Client(base_url=gateway_server.url, headers=gateway_server.admin_headers())
    c = bounded.chat()
    try:
        acked = bounded.reward({"completion_id": c["id"], "reward": 0.9, "idempotency_key": "k9"})
        assert acked.status_code == 200, acked.text
        r = admin.patch(f"/admin/v1/runs/{rid}", json={"config": {"reward_max": 0.5}})
        assert r.status_code == 200, r.text
        fresh = bounded.chat()
        with no_writes(gateway_server):
            assert_error(
                bounded.reward({"completion_id": fresh["id"], "reward": 0.9}),
                422,
                code="reward_out_of_bounds",
            )
            # A retry of a reward acknowledged before the change still answers its original
            # acknowledgement: the client must learn it was stored, not that it was refused.
            again = bounded.reward(
                {"completion_id": c["id"], "reward": 0.9, "idempotency_key": "k9"}
            )
            assert again.status_code == 200, again.text
            assert again.json()["duplicate"] is True and again.json()["id"] == acked.json()["id"]
        # bounds that cross are refused, and the old ones stay
        crossed = admin.patch(f"/admin/v1/runs/{rid}", json={"config": {"reward_min": 0.6}})
        assert_error(crossed, 400, param="config")
        assert admin.get(f"/admin/v1/runs/{rid}").json()["config"]["reward_min"] == -1.0
    finally:
        admin.patch(f"/admin/v1/runs/{rid}", json={"config": BOUNDS})
        admin.close()


def test_a_run_without_bounds_takes_any_finite_reward(two_runs: tuple[Agent, Agent]) -> None:
    a, _ = two_runs
    c = a.chat()
    assert a.reward({"completion_id": c["id"], "reward": 1e6}).status_code == 200


# --- one idempotency key, two runs -----------------------------------------------------------


def test_the_same_key_in_two_runs_stores_two_rewards(
    two_runs: tuple[Agent, Agent], gateway_server: GatewayServer
) -> None:
    a, b = two_runs
    ca, cb = a.chat(), b.chat()
    key = "shared-key-1"
    ack_a = a.reward({"completion_id": ca["id"], "reward": 1.0, "idempotency_key": key})
    # another run, another body under the same key: not a conflict, not a duplicate
    ack_b = b.reward({"completion_id": cb["id"], "reward": 0.0, "idempotency_key": key})
    assert ack_a.status_code == ack_b.status_code == 200, (ack_a.text, ack_b.text)
    assert ack_a.json()["duplicate"] is False and ack_b.json()["duplicate"] is False
    assert ack_a.json()["id"] != ack_b.json()["id"]
    assert ack_a.json()["run_id"] == a.run["run_id"] and ack_b.json()["run_id"] == b.run["run_id"]
    rows = gateway_server.query(
        "SELECT run_id, completion_id, value FROM rewards WHERE idempotency_key = ? ORDER BY id",
        (key,),
    )
    assert rows == [(a.run["run_id"], ca["id"], 1.0), (b.run["run_id"], cb["id"], 0.0)]
    assert _reward_of(gateway_server, ca["id"]) == 1.0
    assert _reward_of(gateway_server, cb["id"]) == 0.0

    # each run's retry replays its own acknowledgement, never the other run's
    with no_writes(gateway_server):
        again_b = b.reward({"completion_id": cb["id"], "reward": 0.0, "idempotency_key": key})
        assert again_b.json()["duplicate"] is True and again_b.json()["id"] == ack_b.json()["id"]
        again_a = a.reward({"completion_id": ca["id"], "reward": 1.0, "idempotency_key": key})
        assert again_a.json()["duplicate"] is True and again_a.json()["id"] == ack_a.json()["id"]
        # a conflict stays within its run
        assert_error(
            b.reward({"completion_id": cb["id"], "reward": 1.0, "idempotency_key": key}),
            409,
            code="idempotency_conflict",
        )


def test_a_key_used_by_another_run_does_not_reach_its_episode(
    two_runs: tuple[Agent, Agent], gateway_server: GatewayServer
) -> None:
    """Run B replaying A's key with A's episode id is a 404 on B's side, not A's ack."""
    a, b = two_runs
    ca = a.chat()
    key = "shared-key-2"
    body = {"episode_id": ca["episode_id"], "reward": 0.5, "idempotency_key": key}
    assert a.reward(body).status_code == 200
    with no_writes(gateway_server):
        assert_error(b.reward(body), 404, param="episode_id")


def test_the_same_key_in_one_batch_per_run(
    two_runs: tuple[Agent, Agent], gateway_server: GatewayServer
) -> None:
    a, b = two_runs
    key = "shared-key-3"
    for agent in (a, b):
        c = agent.chat()
        item = {"completion_id": c["id"], "reward": 0.25, "idempotency_key": key}
        acks = agent.reward([item, item])
        assert acks.status_code == 200, acks.text
        assert [x["duplicate"] for x in acks.json()] == [False, True]
    n = gateway_server.query("SELECT COUNT(*) FROM rewards WHERE idempotency_key = ?", (key,))
    assert n == [(2,)]
