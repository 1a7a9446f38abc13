"""Reward idempotency, late rewards, batches and concurrency against a gateway on PostgreSQL."""

from __future__ import annotations

import threading
import uuid

import httpx
import pytest

from tests.api.conftest import PgGateway

pytestmark = pytest.mark.integration


def _completion(pg: PgGateway, episode: str) -> dict:
    resp = pg.chat(metadata={"episode_id": episode})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _rewards(pg: PgGateway, where: str, params: tuple) -> list[tuple]:
    return pg.conn.execute(
        f"SELECT value, idempotency_key FROM rewards WHERE {where}", params
    ).fetchall()


def test_same_key_same_body_is_stored_once(pg: PgGateway) -> None:
    c = _completion(pg, "idem-1")
    body = {"completion_id": c["id"], "reward": 0.5, "idempotency_key": "k-idem-1"}
    first = pg.http.post("/v1/rewards", json=body)
    again = pg.http.post("/v1/rewards", json=body)
    assert first.status_code == again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    assert first.json()["duplicate"] is False and again.json()["duplicate"] is True
    assert _rewards(pg, "idempotency_key = %s", ("k-idem-1",)) == [(0.5, "k-idem-1")]


def test_same_key_other_body_is_409_and_writes_nothing(pg: PgGateway) -> None:
    c = _completion(pg, "idem-2")
    key = "k-idem-2"
    assert (
        pg.http.post(
            "/v1/rewards", json={"completion_id": c["id"], "reward": 1.0, "idempotency_key": key}
        ).status_code
        == 200
    )
    before = pg.count("rewards")
    resp = pg.http.post(
        "/v1/rewards", json={"completion_id": c["id"], "reward": 0.0, "idempotency_key": key}
    )
    assert resp.status_code == 409
    assert resp.json()["error"]["code"] == "idempotency_conflict"
    assert pg.count("rewards") == before


def test_concurrent_duplicates_store_one_row_and_fail_nobody(pg: PgGateway) -> None:
    c = _completion(pg, "idem-3")
    key = "k-idem-3-" + uuid.uuid4().hex
    body = {"completion_id": c["id"], "reward": 0.25, "idempotency_key": key}
    barrier = threading.Barrier(8)
    results: list[httpx.Response] = []
    lock = threading.Lock()

    def post() -> None:
        with httpx.Client(base_url=pg.server.url, headers=pg.http.headers, timeout=60) as http:
            barrier.wait()
            resp = http.post("/v1/rewards", json=body)
        with lock:
            results.append(resp)

    threads = [threading.Thread(target=post) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [200] * 8, [r.text for r in results]
    assert len({r.json()["id"] for r in results}) == 1
    assert sum(not r.json()["duplicate"] for r in results) == 1
    assert _rewards(pg, "idempotency_key = %s", (key,)) == [(0.25, key)]


def test_late_reward_is_stored_and_counted_never_retrained(pg: PgGateway) -> None:
    c = _completion(pg, "late-1")
    assert (
        pg.http.post("/v1/rewards", json={"episode_id": "late-1", "reward": 1.0}).status_code == 200
    )
    # the episode was trained meanwhile (as the trainer marks it)
    pg.conn.execute(
        "UPDATE episodes SET status = 'trained', train_step = 0 WHERE id = %s", ("late-1",)
    )
    resp = pg.http.post("/v1/rewards", json={"completion_id": c["id"], "reward": 0.0})
    assert resp.status_code == 200
    assert resp.json()["episode_status"] == "trained"
    assert _rewards(pg, "episode_id = %s ORDER BY id", ("late-1",)) == [(1.0, None), (0.0, None)]
    status, reward = pg.conn.execute(
        "SELECT status, reward FROM episodes WHERE id = %s", ("late-1",)
    ).fetchone()
    assert (status, reward) == ("trained", 1.0)  # the trained outcome is not rewritten
    counters = pg.conn.execute(
        "SELECT counters FROM runs WHERE id = %s", (pg.run["run_id"],)
    ).fetchone()[0]
    assert counters["late_rewards"] >= 1


def test_batch_is_all_or_nothing(pg: PgGateway) -> None:
    a, b = _completion(pg, "batch-1"), _completion(pg, "batch-2")
    before = pg.count("rewards")
    bad = [
        {"completion_id": a["id"], "reward": 1.0},
        {"completion_id": "chatcmpl-missing", "reward": 1.0},
    ]
    resp = pg.http.post("/v1/rewards", json=bad)
    assert resp.status_code == 404
    assert pg.count("rewards") == before
    good = [{"completion_id": a["id"], "reward": 1.0}, {"episode_id": "batch-2", "reward": 0.0}]
    resp = pg.http.post("/v1/rewards", json=good)
    assert resp.status_code == 200
    acks = resp.json()
    assert [x["episode_id"] for x in acks] == ["batch-1", "batch-2"]
    assert pg.count("rewards") == before + 2
    del b


def test_repeated_key_inside_one_batch(pg: PgGateway) -> None:
    c = _completion(pg, "batch-3")
    item = {"completion_id": c["id"], "reward": 0.3, "idempotency_key": "k-batch-3"}
    resp = pg.http.post("/v1/rewards", json=[item, item])
    assert resp.status_code == 200
    acks = resp.json()
    assert acks[0]["id"] == acks[1]["id"] and acks[1]["duplicate"] is True
    assert _rewards(pg, "idempotency_key = %s", ("k-batch-3",)) == [(0.3, "k-batch-3")]
    clash = [item, {**item, "reward": 0.9}]
    assert pg.http.post("/v1/rewards", json=clash).status_code == 409
