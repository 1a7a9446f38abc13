"""The gateway on PostgreSQL: the same API, the same store, the same bad-input guarantees.

Each module run gets a fresh schema, made the search_path of the gateway's
connections through PGOPTIONS, and dropped afterwards.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.api.conftest import USER, PgGateway

pytestmark = pytest.mark.integration


def test_migrated_into_the_schema(pg: PgGateway) -> None:
    tables = {
        r[0]
        for r in pg.conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()"
        )
    }
    assert {"runs", "completions", "rewards", "alembic_version"} <= tables
    assert pg.count("runs") == 1


def test_completion_and_reward_round_trip(pg: PgGateway, tiny_model_dir: Path) -> None:
    from inference.chat_template import ChatTemplate

    resp = pg.chat(max_tokens=8, temperature=0.9, seed=11)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    row = pg.conn.execute(
        "SELECT prompt_token_ids, output_token_ids, output_logprobs, content FROM completions "
        "WHERE id = %s",
        (out["id"],),
    ).fetchone()
    prompt = np.frombuffer(row[0], dtype="<i4").tolist()
    output = np.frombuffer(row[1], dtype="<i4").tolist()
    assert len(np.frombuffer(row[2], dtype="<f4")) == len(output)
    template = ChatTemplate(tiny_model_dir)
    assert prompt == template.render(USER)
    assert template.decode(output) == out["choices"][0]["message"]["content"] == row[3]

    body = {"reward": 1.0, "completion_id": out["id"], "idempotency_key": "pg-1"}
    first = pg.http.post("/v1/rewards", json=body)
    again = pg.http.post("/v1/rewards", json=body)
    assert first.status_code == again.status_code == 200, (first.text, again.text)
    assert again.json()["id"] == first.json()["id"] and again.json()["duplicate"] is True
    conflict = pg.http.post("/v1/rewards", json={**body, "reward": 0.0})
    assert conflict.status_code == 409, conflict.text
    stored = pg.conn.execute(
        "SELECT COUNT(*), MAX(value) FROM rewards WHERE idempotency_key = 'pg-1'"
    ).fetchone()
    assert stored == (1, 1.0)


@pytest.mark.parametrize(
    "body",
    [
        {"reward": 1.0, "completion_id": "chatcmpl-a\u0000b"},
        {"reward": 1.0, "episode_id": "ep-a\u0000b"},
        {"reward": 1.0, "episode_id": "ep-none", "idempotency_key": "k\u0000"},
    ],
    ids=["completion_id", "episode_id", "idempotency_key"],
)
def test_nul_in_reward_ids_is_a_4xx(pg: PgGateway, body: dict) -> None:
    n = pg.count("rewards")
    resp = pg.http.post("/v1/rewards", json=body)
    assert pg.count("rewards") == n
    assert 400 <= resp.status_code < 500, resp.text


@pytest.mark.parametrize("key", ["episode_id", "group_id"])
def test_nul_in_metadata_ids_is_a_4xx(pg: PgGateway, key: str) -> None:
    n = pg.count("completions")
    resp = pg.chat(max_tokens=1, metadata={key: "a\u0000b"})
    assert pg.count("completions") == n
    assert 400 <= resp.status_code < 500, resp.text


def test_overlong_ids_are_a_4xx_on_postgres(pg: PgGateway) -> None:
    n = pg.count("completions")
    resp = pg.chat(max_tokens=1, metadata={"episode_id": "e" * 150})
    assert resp.status_code == 400, resp.text
    resp = pg.http.post(
        "/v1/chat/completions",
        json={"model": pg.run["name"], "messages": USER, "max_tokens": 1},
        headers={"X-Group-Id": "g" * 101},
    )
    assert resp.status_code == 400, resp.text
    resp = pg.http.post("/v1/rewards", json={"reward": 1.0, "episode_id": "e" * 101})
    assert resp.status_code == 400, resp.text
    assert pg.count("completions") == n
