"""Episode export: the admin endpoint and `rlgate export` return exactly what the store holds."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sqlalchemy.ext.asyncio import async_sessionmaker

from core.store.db import make_async_engine
from gateway.admin.export import PARQUET_SCHEMA, ExportFilter, ExportService

if TYPE_CHECKING:
    from tests.conftest import GatewayServer

pytestmark = pytest.mark.integration

# episode -> (group, one reward per turn; None: that turn gets no reward)
PLAN: dict[str, tuple[str, list[float | None]]] = {
    "ex-a1": ("task-a", [0.25, 0.5]),
    "ex-a2": ("task-a", [1.0]),
    "ex-b1": ("task-b", [0.0]),
    "ex-b2": ("task-b", [None]),
}
EXPECTED = {  # episode -> (status, episode reward): turn rewards sum once all turns have one
    "ex-a1": ("rewarded", 0.75),
    "ex-a2": ("rewarded", 1.0),
    "ex-b1": ("rewarded", 0.0),
    "ex-b2": ("open", None),
}


@pytest.fixture(scope="module")
def run(gateway_server: GatewayServer) -> dict:
    """A run with four episodes in two groups, one of them two turns long, mostly rewarded.

    The default group_size (4) is never reached, so no train step changes a status meanwhile.
    """
    run = gateway_server.create_run(name="export")
    root = run["base_url"].removesuffix("/v1")
    to_reward: list[tuple[str, float]] = []
    for seed, (episode, (group, rewards)) in enumerate(PLAN.items()):
        base_url = f"{root}/groups/{group}/episodes/{episode}/v1"
        messages: list[dict[str, str]] = [{"role": "user", "content": f"task {group}: go"}]
        with openai.OpenAI(base_url=base_url, api_key=run["api_key"], max_retries=0) as client:
            for turn, reward in enumerate(rewards):
                done = client.chat.completions.create(
                    model=run["name"], messages=messages, max_tokens=6, seed=seed * 10 + turn
                )
                assert done.model_extra["episode_id"] == episode
                messages += [
                    {"role": "assistant", "content": done.choices[0].message.content or ""},
                    {"role": "user", "content": "more"},
                ]
                if reward is not None:
                    to_reward.append((done.id, reward))
    # Rewards after all turns: an episode counts as rewarded once every turn it has so far has one.
    auth = {"Authorization": f"Bearer {run['api_key']}"}
    for completion_id, reward in to_reward:
        resp = httpx.post(
            f"{root}/v1/rewards",
            json={"completion_id": completion_id, "reward": reward},
            headers=auth,
            timeout=30,
        )
        assert resp.status_code == 200, resp.text
    return run


def _export(server: GatewayServer, run_id: str, **params: Any) -> httpx.Response:
    return httpx.get(
        f"{server.url}/admin/v1/runs/{run_id}/export",
        params=params,
        headers=server.admin_headers(),
        timeout=60,
    )


def _jsonl(server: GatewayServer, run_id: str, **params: Any) -> list[dict]:
    resp = _export(server, run_id, format="jsonl", **params)
    assert resp.status_code == 200, resp.text
    return [json.loads(line) for line in resp.text.splitlines()]


def _store_episodes(server: GatewayServer, run_id: str) -> dict[str, tuple]:
    rows = server.query(
        "SELECT id, group_id, status, reward, train_step FROM episodes WHERE run_id = ?",
        (run_id,),
    )
    return {r[0]: r[1:] for r in rows}


def test_jsonl_records_match_the_store(gateway_server: GatewayServer, run: dict) -> None:
    resp = _export(gateway_server, run["run_id"], format="jsonl")
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("application/x-ndjson")
    records = [json.loads(line) for line in resp.text.splitlines()]
    assert [r["episode_id"] for r in records] == list(PLAN)  # oldest first
    stored = _store_episodes(gateway_server, run["run_id"])
    for rec in records:
        group, rewards = PLAN[rec["episode_id"]]
        status, reward = EXPECTED[rec["episode_id"]]
        assert (rec["run_id"], rec["group_id"], rec["status"]) == (run["run_id"], group, status)
        assert rec["reward"] == reward
        assert (rec["group_id"], rec["status"], rec["reward"], rec["train_step"]) == stored[
            rec["episode_id"]
        ]
        assert datetime.fromisoformat(rec["created_at"]).tzinfo is not None
        assert [c["reward"] for c in rec["completions"]] == rewards
        for c in rec["completions"]:
            db = gateway_server.completion(c["completion_id"])
            assert db is not None and db["episode_id"] == rec["episode_id"]
            for field in ("prompt_token_ids", "output_token_ids", "output_logprobs"):
                assert c[field] == db[field], field
            for field in ("parent_id", "content", "finish_reason", "temperature", "reward"):
                assert c[field] == db[field], field
            assert c["policy_version"] == db["policy_version"] == 0
            assert c["messages"] == json.loads(db["messages"])
            n_prompt, n_out = len(db["prompt_token_ids"]), len(db["output_token_ids"])
            assert n_out > 0
            assert c["loss_mask"] == [0] * n_prompt + [1] * n_out
            assert datetime.fromisoformat(c["created_at"]).tzinfo is not None
    two_turns = records[0]["completions"]
    assert len(two_turns) == 2 and two_turns[1]["messages"][:1] == two_turns[0]["messages"]


def test_filters(gateway_server: GatewayServer, run: dict) -> None:
    def ids(**params: Any) -> list[str]:
        return [r["episode_id"] for r in _jsonl(gateway_server, run["run_id"], **params)]

    assert ids(status="rewarded") == ["ex-a1", "ex-a2", "ex-b1"]
    assert ids(status="open") == ["ex-b2"]
    assert ids(status="trained") == []
    assert ids(min_version=0) == list(PLAN)
    assert ids(min_version=1) == []  # every sample came from version 0


async def test_pages_follow_created_at_and_id(gateway_server: GatewayServer, run: dict) -> None:
    """Keyset paging with one episode per page gives the same records as one big page."""
    engine = make_async_engine(gateway_server.settings.resolved_database_url)
    try:
        sessions = async_sessionmaker(engine, expire_on_commit=False)
        for filt in (ExportFilter(), ExportFilter(status="rewarded")):
            small = [
                p async for p in ExportService(sessions, page_size=1).pages(run["run_id"], filt)
            ]
            big = [p async for p in ExportService(sessions).pages(run["run_id"], filt)]
            assert all(len(p) == 1 for p in small)
            assert [r for p in small for r in p] == big[0]
    finally:
        await engine.dispose()


def test_parquet_has_nested_columns_and_the_same_records(
    gateway_server: GatewayServer, run: dict
) -> None:
    resp = _export(gateway_server, run["run_id"], format="parquet")
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"] == "application/vnd.apache.parquet"
    table = pq.read_table(io.BytesIO(resp.content))
    assert table.schema.equals(PARQUET_SCHEMA)
    completion = table.schema.field("completions").type.value_type
    assert completion.field("output_logprobs").type == pa.list_(pa.float32())
    assert completion.field("prompt_token_ids").type == pa.list_(pa.int32())
    assert _normalised(table.to_pylist()) == _jsonl(gateway_server, run["run_id"])

    empty = _export(gateway_server, run["run_id"], format="parquet", min_version=1)
    assert empty.status_code == 200, empty.text
    table = pq.read_table(io.BytesIO(empty.content))
    assert table.num_rows == 0 and table.schema.equals(PARQUET_SCHEMA)


def _normalised(rows: list[dict]) -> list[dict]:
    """Parquet rows in the JSONL shape: timestamps as ISO strings, messages decoded."""
    for row in rows:
        row["created_at"] = row["created_at"].isoformat()
        for c in row["completions"]:
            c["created_at"] = c["created_at"].isoformat()
            c["messages"] = json.loads(c["messages"])
    return rows


def _cli(server: GatewayServer, *args: str, admin_key: str | None = None):
    env = os.environ | {"RLGATE_URL": server.url, "RLGATE_ADMIN_KEY": admin_key or server.admin_key}
    return subprocess.run(
        [sys.executable, "-m", "rlgate.cli", "export", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_writes_jsonl_and_parquet(
    gateway_server: GatewayServer, run: dict, tmp_path: Path
) -> None:
    out = tmp_path / "episodes.jsonl"
    done = _cli(gateway_server, "--run", run["run_id"], "--format", "jsonl", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert f"wrote {len(PLAN)} episodes" in done.stdout
    assert out.read_bytes() == _export(gateway_server, run["run_id"], format="jsonl").content

    out = tmp_path / "episodes.parquet"
    done = _cli(gateway_server, "--run", run["run_id"], "--format", "parquet", "--out", str(out))
    assert done.returncode == 0, done.stderr
    rows = _normalised(pq.read_table(out).to_pylist())
    assert rows == _jsonl(gateway_server, run["run_id"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["episodes.jsonl", "episodes.parquet"]


def test_cli_fails_clearly_and_writes_nothing(
    gateway_server: GatewayServer, tmp_path: Path
) -> None:
    out = tmp_path / "missing.jsonl"
    done = _cli(gateway_server, "--run", "run_nope", "--out", str(out))
    assert done.returncode == 1
    assert "HTTP 404" in done.stderr and "run_nope" in done.stderr
    done = _cli(gateway_server, "--run", "run_nope", "--out", str(out), admin_key="wrong")
    assert done.returncode == 1 and "HTTP 401" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_unknown_run_is_404(gateway_server: GatewayServer) -> None:
    resp = _export(gateway_server, "run_does_not_exist")
    assert resp.status_code == 404
    err = resp.json()["error"]
    assert err["type"] == "not_found_error" and err["param"] == "run_id"
    assert set(err) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"format": "csv"}, "format"),
        ({"status": "done"}, "status"),
        ({"min_version": -1}, "min_version"),
    ],
)
def test_bad_query_is_400(
    gateway_server: GatewayServer, run: dict, params: dict, param: str
) -> None:
    resp = _export(gateway_server, run["run_id"], **params)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param


def test_agent_key_is_401(gateway_server: GatewayServer, run: dict) -> None:
    url = f"{gateway_server.url}/admin/v1/runs/{run['run_id']}/export"
    for headers in ({"Authorization": f"Bearer {run['api_key']}"}, {}):
        resp = httpx.get(url, headers=headers, timeout=30)
        assert resp.status_code == 401, resp.text
        assert resp.json()["error"]["type"] == "authentication_error"
