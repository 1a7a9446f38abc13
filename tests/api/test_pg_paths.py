"""Streaming, the Responses API, export and reward idempotency on PostgreSQL, not only SQLite.

One gateway on a fresh PostgreSQL schema (the `pg` fixture); every answer is
checked against the rows PostgreSQL holds.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import openai
import pyarrow.parquet as pq
import pytest

from gateway.admin.export import PARQUET_SCHEMA
from inference.chat_template import ChatTemplate

if TYPE_CHECKING:
    from tests.api.conftest import PgGateway

pytestmark = pytest.mark.integration

COLUMNS = (
    "id, run_id, episode_id, parent_id, prompt_token_ids, output_token_ids, output_logprobs, "
    "content, finish_reason, temperature, policy_version, reward, messages"
)


@pytest.fixture(scope="module")
def template(tiny_model_dir: Path) -> ChatTemplate:
    return ChatTemplate(tiny_model_dir)


@pytest.fixture(scope="module")
def client(pg: PgGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=pg.run["base_url"], api_key=pg.run["api_key"], max_retries=0)


def stored(pg: PgGateway, completion_id: str) -> dict[str, Any] | None:
    """One completion row from PostgreSQL, its packed arrays decoded."""
    row = pg.conn.execute(
        f"SELECT {COLUMNS} FROM completions WHERE id = %s", (completion_id,)
    ).fetchone()
    if row is None:
        return None
    out = dict(zip([c.strip() for c in COLUMNS.split(",")], row, strict=True))
    for name in ("prompt_token_ids", "output_token_ids"):
        out[name] = np.frombuffer(out[name], dtype="<i4").tolist()
    out["output_logprobs"] = np.frombuffer(out["output_logprobs"], dtype="<f4").tolist()
    if isinstance(out["messages"], str):
        out["messages"] = json.loads(out["messages"])
    return out


def wait_stored(pg: PgGateway, completion_id: str, timeout_s: float = 15) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while (row := stored(pg, completion_id)) is None:
        assert time.monotonic() < deadline, f"{completion_id} was never stored"
        time.sleep(0.1)
    return row


# --- streaming chat ----------------------------------------------------------------------------


def test_stream_stores_exactly_what_was_streamed(
    pg: PgGateway, client: openai.OpenAI, template: ChatTemplate
) -> None:
    chunks = list(
        client.chat.completions.create(
            model=pg.run["name"],
            messages=[{"role": "user", "content": "tell me about the river"}],
            max_tokens=16,
            stream=True,
            seed=5,
            logprobs=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed_lps = [
        t.logprob
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    row = stored(pg, chunks[0].id)  # committed before the stream's last event
    assert row is not None and row["run_id"] == pg.run["run_id"]
    assert row["finish_reason"] in ("stop", "length")
    assert template.decode(row["output_token_ids"]) == text == row["content"]
    assert streamed_lps == pytest.approx(row["output_logprobs"], abs=1e-5)
    assert chunks[-1].usage.completion_tokens == len(row["output_token_ids"])
    assert chunks[-1].usage.prompt_tokens == len(row["prompt_token_ids"])


def test_stream_disconnect_stores_the_partial_sample(pg: PgGateway) -> None:
    budget = 300
    for word in ("river", "garden", "forest", "cloud", "stone"):
        body = {
            "model": pg.run["name"],
            "messages": [{"role": "user", "content": word}],
            "max_tokens": budget,
            "temperature": 0.0,
        }
        probe = pg.http.post("/v1/chat/completions", json=body).json()
        if probe["choices"][0]["finish_reason"] == "length":
            break  # greedy runs the whole budget: a disconnect lands mid-generation
    else:
        pytest.fail("every greedy probe stopped early; nothing to cancel")
    with pg.http.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as resp:
        for line in resp.iter_lines():  # up to the first sampled text, then hang up
            if line.startswith("data: "):
                chunk = json.loads(line[len("data: ") :])
                if chunk["choices"][0]["delta"].get("content"):
                    break
    row = wait_stored(pg, chunk["id"])
    assert row["finish_reason"] == "cancelled"
    assert 0 < len(row["output_token_ids"]) < budget
    full = stored(pg, probe["id"])["output_token_ids"]
    assert row["output_token_ids"] == full[: len(row["output_token_ids"])]


# --- the Responses API ---------------------------------------------------------------------------


def test_responses_chain_retrieve_and_store_on_postgres(
    pg: PgGateway, client: openai.OpenAI, template: ChatTemplate
) -> None:
    first = client.responses.create(
        model=pg.run["name"], input="first question", max_output_tokens=6
    )
    second = client.responses.create(
        model=pg.run["name"],
        input="second question",
        previous_response_id=first.id,
        max_output_tokens=6,
    )
    row1 = stored(pg, first.model_extra["completion_id"])
    row2 = stored(pg, second.model_extra["completion_id"])
    assert first.output_text == row1["content"] == template.decode(row1["output_token_ids"])
    assert row2["messages"] == [
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "second question"},
    ]
    assert row2["parent_id"] == row1["id"] and row2["episode_id"] == row1["episode_id"]
    assert client.responses.retrieve(second.id).output_text == second.output_text
    ids = {r[0] for r in pg.conn.execute("SELECT id FROM responses")}
    assert {first.id, second.id} <= ids

    gone = client.responses.create(
        model=pg.run["name"], input="forget me", max_output_tokens=2, store=False
    )
    assert gone.id not in {r[0] for r in pg.conn.execute("SELECT id FROM responses")}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)


def test_responses_stream_on_postgres(pg: PgGateway, client: openai.OpenAI) -> None:
    with client.responses.create(
        model=pg.run["name"], input="tell me about the garden", max_output_tokens=12, stream=True
    ) as stream:
        events = list(stream)
    final = events[-1].response
    assert events[-1].type in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    row = stored(pg, final.model_extra["completion_id"])
    assert text == final.output_text == row["content"]
    assert final.usage.output_tokens == len(row["output_token_ids"])
    assert client.responses.retrieve(final.id).output_text == text


# --- export ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported_run(pg: PgGateway) -> dict:
    """A run of its own with two rewarded episodes (one of two turns) and one open one."""
    run = pg.server.create_run(name="pg-export")
    root = run["base_url"].removesuffix("/v1")
    for episode, turns, reward in (("x-1", 2, 0.5), ("x-2", 1, 1.0), ("x-3", 1, None)):
        base_url = f"{root}/groups/g/episodes/{episode}/v1"
        messages = [{"role": "user", "content": f"episode {episode}"}]
        with openai.OpenAI(base_url=base_url, api_key=run["api_key"], max_retries=0) as c:
            for _ in range(turns):
                done = c.chat.completions.create(model=run["name"], messages=messages, max_tokens=4)
                messages += [
                    {"role": "assistant", "content": done.choices[0].message.content or ""},
                    {"role": "user", "content": "more"},
                ]
            if reward is not None:
                c.post("/rewards", body={"episode_id": episode, "reward": reward}, cast_to=object)
    return run


def _export(pg: PgGateway, run_id: str, **params: Any):
    resp = pg.http.get(
        f"/admin/v1/runs/{run_id}/export",
        params=params,
        headers=pg.server.admin_headers(),
    )
    assert resp.status_code == 200, resp.text
    return resp


def test_export_jsonl_matches_postgres(pg: PgGateway, exported_run: dict) -> None:
    rid = exported_run["run_id"]
    records = [json.loads(line) for line in _export(pg, rid).text.splitlines()]
    assert [r["episode_id"] for r in records] == ["x-1", "x-2", "x-3"]
    episodes = {
        r[0]: r[1:]
        for r in pg.conn.execute(
            "SELECT id, group_id, status, reward FROM episodes WHERE run_id = %s", (rid,)
        )
    }
    assert episodes["x-1"] == ("g", "rewarded", 0.5) and episodes["x-3"][1] == "open"
    for rec in records:
        assert (rec["group_id"], rec["status"], rec["reward"]) == episodes[rec["episode_id"]]
        for c in rec["completions"]:
            db = stored(pg, c["completion_id"])
            assert db["run_id"] == rid and db["episode_id"] == rec["episode_id"]
            for field in ("prompt_token_ids", "output_token_ids", "output_logprobs"):
                assert c[field] == db[field], field
            for field in ("parent_id", "content", "finish_reason", "policy_version", "messages"):
                assert c[field] == db[field], field
            assert c["loss_mask"] == [0] * len(db["prompt_token_ids"]) + [1] * len(
                db["output_token_ids"]
            )
    assert len(records[0]["completions"]) == 2
    assert (
        records[0]["completions"][1]["parent_id"] == records[0]["completions"][0]["completion_id"]
    )

    # the filters run as PostgreSQL queries too
    def ids(**params: Any) -> list[str]:
        lines = _export(pg, rid, **params).text.splitlines()
        return [json.loads(line)["episode_id"] for line in lines]

    assert ids(status="rewarded") == ["x-1", "x-2"]
    assert ids(min_version=0) == ["x-1", "x-2", "x-3"] and ids(min_version=1) == []


def test_export_parquet_matches_jsonl_on_postgres(pg: PgGateway, exported_run: dict) -> None:
    rid = exported_run["run_id"]
    table = pq.read_table(io.BytesIO(_export(pg, rid, format="parquet").content))
    assert table.schema.equals(PARQUET_SCHEMA)
    rows = table.to_pylist()
    jsonl = [json.loads(line) for line in _export(pg, rid).text.splitlines()]
    assert [r["episode_id"] for r in rows] == [r["episode_id"] for r in jsonl]
    for row, rec in zip(rows, jsonl, strict=True):
        assert row["created_at"].isoformat() == rec["created_at"]
        for c, j in zip(row["completions"], rec["completions"], strict=True):
            assert json.loads(c["messages"]) == j["messages"]
            assert c["output_token_ids"] == j["output_token_ids"]
            assert c["output_logprobs"] == j["output_logprobs"]  # float32 both ways


# --- one idempotency key, two runs, on PostgreSQL ----------------------------------------------


def test_the_same_idempotency_key_in_two_runs(pg: PgGateway, exported_run: dict) -> None:
    other = openai.OpenAI(
        base_url=exported_run["base_url"], api_key=exported_run["api_key"], max_retries=0
    )
    mine = pg.chat().json()
    theirs = other.chat.completions.create(
        model=exported_run["name"], messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    key = "pg-shared-key"
    a = pg.http.post(
        "/v1/rewards", json={"completion_id": mine["id"], "reward": 1.0, "idempotency_key": key}
    )
    b = other.post(
        "/rewards",
        body={"completion_id": theirs.id, "reward": 0.0, "idempotency_key": key},
        cast_to=object,
    )
    assert a.status_code == 200 and a.json()["duplicate"] is False, a.text
    assert b["duplicate"] is False and b["id"] != a.json()["id"]
    again = pg.http.post(
        "/v1/rewards", json={"completion_id": mine["id"], "reward": 1.0, "idempotency_key": key}
    )
    assert again.json()["duplicate"] is True and again.json()["id"] == a.json()["id"]
    rows = pg.conn.execute(
        "SELECT run_id, value FROM rewards WHERE idempotency_key = %s ORDER BY id", (key,)
    ).fetchall()
    assert rows == [(pg.run["run_id"], 1.0), (exported_run["run_id"], 0.0)]
