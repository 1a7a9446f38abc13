"""Held-out figures through a real gateway: `/eval` calls, their rewards, admin rows, export.

Evaluation episodes are sampled under `/eval` by the tiny model, rewarded per
episode and per completion (one reward revised), and one training episode runs
beside them. `GET /admin/v1/runs/{run_id}/evals` must equal a recomputation
from the `eval` split of the export (JSON lines, Parquet and `rlgate export`),
and the default export must hold no evaluation episode. The run has one
version, so the episode that spans a swap is made by writing its completion's
`version_starts` in the store directly, as a keep-mode swap mid-generation
would have recorded it.
"""

from __future__ import annotations

import io
import json
import math
import sqlite3
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pyarrow.parquet as pq
import pytest
from sqlalchemy.ext.asyncio import async_sessionmaker

from core.store.db import make_async_engine
from gateway.admin.export import ExportFilter, ExportService
from rlgate.export_cli import ExportQuery, export

if TYPE_CHECKING:
    from tests.conftest import GatewayServer

pytestmark = pytest.mark.integration

# evaluation episode -> turns; rewards are posted after every call
EVAL_TURNS = {"ev-a": 1, "ev-b": 2, "ev-c": 1, "ev-d": 1, "ev-s": 1}
TRAIN = "tr-1"


def _chat(root: str, key: str, path: str, model: str, seed: int, turns: int) -> list[str]:
    """`turns` chat calls of one conversation under `root + path`; their completion ids."""
    ids: list[str] = []
    messages: list[dict[str, str]] = [{"role": "user", "content": f"held-out task {seed}"}]
    with openai.OpenAI(base_url=root + path, api_key=key, max_retries=0) as client:
        for turn in range(turns):
            done = client.chat.completions.create(
                model=model, messages=messages, max_tokens=6, seed=seed * 10 + turn
            )
            ids.append(done.id)
            messages += [
                {"role": "assistant", "content": done.choices[0].message.content or ""},
                {"role": "user", "content": "again"},
            ]
    return ids


@pytest.fixture(scope="module")
def world(gateway_server: GatewayServer) -> dict[str, Any]:
    run = gateway_server.create_run(name="eval-admin")
    root = run["base_url"].removesuffix("/v1")
    key, model = run["api_key"], run["name"]
    turns = {
        ep: _chat(root, key, f"/eval/episodes/{ep}/v1", model, seed, n)
        for seed, (ep, n) in enumerate(EVAL_TURNS.items())
    }
    (train_turn,) = _chat(root, key, f"/episodes/{TRAIN}/v1", model, 99, 1)
    posts = [
        {"episode_id": "ev-a", "reward": 1.0},
        {"completion_id": turns["ev-b"][0], "reward": 0.25},
        {"completion_id": turns["ev-b"][1], "reward": 3.0},
        {"completion_id": turns["ev-b"][1], "reward": 0.5},  # revised: 0.25 + 0.5
        {"episode_id": "ev-c", "reward": 0.0},
        {"episode_id": "ev-c", "reward": 2.0},  # revised
        {"episode_id": "ev-s", "reward": 5.0},
        {"completion_id": train_turn, "reward": 1.0},
    ]  # ev-d: never rewarded, so not counted
    with httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=30) as http:
        for body in posts:
            resp = http.post(f"{root}/v1/rewards", json=body)
            assert resp.status_code == 200, resp.text
    # ev-s spans a swap: its second output token onwards sampled by version 1.
    (spanning,) = turns["ev-s"]
    stored = gateway_server.completion(spanning)
    assert stored is not None and len(stored["output_token_ids"]) >= 2
    conn = sqlite3.connect(gateway_server.db_path, timeout=30)
    try:
        with conn:
            conn.execute(
                "UPDATE completions SET version_starts = ? WHERE id = ?",
                (json.dumps([[0, 0], [1, 1]]), spanning),
            )
    finally:
        conn.close()
    return {"run": run, "turns": turns}


def _get(server: GatewayServer, path: str, **params: Any) -> httpx.Response:
    return httpx.get(server.url + path, params=params, headers=server.admin_headers(), timeout=60)


def _jsonl(server: GatewayServer, run_id: str, **params: Any) -> list[dict]:
    resp = _get(server, f"/admin/v1/runs/{run_id}/export", format="jsonl", **params)
    assert resp.status_code == 200, resp.text
    return [json.loads(line) for line in resp.text.splitlines()]


def _figures(scores: list[float]) -> dict[str, Any]:
    n = len(scores)
    stderr = statistics.stdev(scores) / math.sqrt(n) if n > 1 else None
    return {"episodes": n, "mean_reward": statistics.fmean(scores), "stderr": stderr}


def _close(a: Any, b: Any) -> bool:
    """Equal, floats within 1e-9 (the store sums and averages in another order)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return type(a) is type(b) and a == b


def _recompute(records: list[dict]) -> dict[str, Any]:
    """The endpoint's answer, from export records alone (the contract's definition)."""
    by_version: dict[int, list[float]] = {}
    spanning: list[float] = []
    for rec in records:
        turn_rewards = [c["reward"] for c in rec["completions"] if c["reward"] is not None]
        if rec["reward"] is None and not turn_rewards:
            continue  # unscored
        score = rec["reward"] if rec["reward"] is not None else sum(turn_rewards)
        versions: set[int] = set()
        for c in rec["completions"]:
            starts = c["version_starts"] or [[0, c["policy_version"]]]
            ends = [s for s, _ in starts[1:]] + [len(c["output_token_ids"])]
            versions |= {v for (s, v), end in zip(starts, ends, strict=True) if end > s}
        if len(versions) == 1:
            by_version.setdefault(versions.pop(), []).append(score)
        else:
            spanning.append(score)
    return {
        "data": [{"version": v, **_figures(by_version[v])} for v in sorted(by_version)],
        "spanning": _figures(spanning) if spanning else None,
    }


def test_rows_equal_a_recomputation_from_the_eval_export(
    gateway_server: GatewayServer, world: dict, tmp_path: Path
) -> None:
    run_id = world["run"]["run_id"]
    resp = _get(gateway_server, f"/admin/v1/runs/{run_id}/evals")
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert (body["object"], body["run_id"]) == ("list", run_id)

    records = _jsonl(gateway_server, run_id, split="eval")
    assert [r["episode_id"] for r in records] == list(EVAL_TURNS)
    assert {(r["status"], r["split"]) for r in records} == {("eval", "eval")}
    expected = _recompute(records)
    assert _close({k: body[k] for k in ("data", "spanning")}, expected), (body, expected)
    # The figures the contract gives, written out: ev-a, ev-b (revised) and ev-c (revised)
    # at version 0; ev-s apart; ev-d unscored.
    v0 = [1.0, 0.75, 2.0]
    assert _close(body["data"], [{"version": 0, **_figures(v0)}])
    assert body["spanning"] == {"episodes": 1, "mean_reward": 5.0, "stderr": None}

    # The Parquet export and `rlgate export --split eval` hold the same records.
    parquet = _get(
        gateway_server, f"/admin/v1/runs/{run_id}/export", format="parquet", split="eval"
    )
    assert parquet.status_code == 200, parquet.text
    rows = pq.read_table(io.BytesIO(parquet.content)).to_pylist()
    assert [(r["episode_id"], r["split"], r["reward"]) for r in rows] == [
        (r["episode_id"], r["split"], r["reward"]) for r in records
    ]
    assert _close(_recompute(rows), expected)
    out = tmp_path / "eval.jsonl"
    assert (
        export(gateway_server.url, gateway_server.admin_key, run_id, out, ExportQuery(split="eval"))
        == 0
    )
    assert [json.loads(line) for line in out.read_text().splitlines()] == records


def test_the_default_export_has_no_evaluation_episode(
    gateway_server: GatewayServer, world: dict
) -> None:
    run_id = world["run"]["run_id"]
    default = _jsonl(gateway_server, run_id)
    assert [(r["episode_id"], r["split"]) for r in default] == [(TRAIN, "train")]
    assert _jsonl(gateway_server, run_id, split="train") == default
    # A status filter stays within its split.
    assert _jsonl(gateway_server, run_id, status="eval") == []
    assert [
        r["episode_id"] for r in _jsonl(gateway_server, run_id, split="eval", status="eval")
    ] == list(EVAL_TURNS)
    assert _jsonl(gateway_server, run_id, split="eval", status="rewarded") == []


def test_unknown_run_is_404_and_agent_keys_are_refused(
    gateway_server: GatewayServer, world: dict
) -> None:
    resp = _get(gateway_server, "/admin/v1/runs/run_nope/evals")
    assert resp.status_code == 404, resp.text
    assert resp.json()["error"]["param"] == "run_id"
    url = f"{gateway_server.url}/admin/v1/runs/{world['run']['run_id']}/evals"
    for headers in ({"Authorization": f"Bearer {world['run']['api_key']}"}, {}):
        resp = httpx.get(url, headers=headers, timeout=30)
        assert resp.status_code == 401, resp.text
    bad = _get(gateway_server, f"/admin/v1/runs/{world['run']['run_id']}/export", split="test")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "split"


def test_a_run_without_evaluation_has_no_rows(gateway_server: GatewayServer) -> None:
    run = gateway_server.create_run(name="eval-none")
    resp = _get(gateway_server, f"/admin/v1/runs/{run['run_id']}/evals")
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"object": "list", "run_id": run["run_id"], "data": [], "spanning": None}


async def test_pages_of_a_split_skip_the_other_split(
    gateway_server: GatewayServer, world: dict
) -> None:
    """Store pages that hold only evaluation episodes yield nothing to the train split, and
    paging one or two episodes at a time gives the same records as one page."""
    engine = make_async_engine(gateway_server.settings.resolved_database_url)
    try:
        sessions = async_sessionmaker(engine, expire_on_commit=False)
        run_id = world["run"]["run_id"]
        for split in ("train", "eval"):
            filt = ExportFilter(split=split)
            whole = [r async for p in ExportService(sessions).pages(run_id, filt) for r in p]
            for size in (1, 2):
                pages = [p async for p in ExportService(sessions, size).pages(run_id, filt)]
                assert all(0 < len(p) <= size for p in pages)
                assert [r for p in pages for r in p] == whole
            assert {r["split"] for r in whole} == {split}
    finally:
        await engine.dispose()
