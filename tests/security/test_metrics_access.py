"""`/metrics`: the admin key unless `metrics_public`, no run ids for the public, no SQL per scrape,
and counters that add up across the processes of `rlgate up --workers N`."""

from __future__ import annotations

import asyncio
import os
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import event

from gateway.app import create_app
from rlgate.stack import free_port, stop, wait_healthy
from tests.conftest import ADMIN_KEY, gateway_settings, serving_in_thread
from tests.faults.load_agents import start_stub
from tests.integration.conftest import fresh_database

pytestmark = pytest.mark.integration

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def _chat(run: dict, content: str = "hi") -> None:
    resp = httpx.post(
        run["base_url"] + "/chat/completions",
        json={"model": run["name"], "messages": [{"role": "user", "content": content}]}
        | {"max_tokens": 4},
        headers={"Authorization": f"Bearer {run['api_key']}"},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text


def _samples(text: str, name: str) -> dict[str, float]:
    """`name`'s samples by their run_id label ("" without one)."""
    return {
        s.labels.get("run_id", ""): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    }


def test_metrics_need_the_admin_key_by_default(gateway_launcher, tmp_path: Path) -> None:
    server = gateway_launcher(tmp_path / "data")
    try:
        bare = httpx.get(server.url + "/metrics", timeout=30)
        wrong = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer x"})
        run_key = server.create_run("m")["api_key"]
        as_run = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {run_key}"})
        ok = httpx.get(server.url + "/metrics", headers=server.admin_headers(), timeout=30)
    finally:
        stop(server.proc)
    for refused in (bare, wrong, as_run):
        assert refused.status_code == 401, refused.text
        error = refused.json()["error"]
        assert set(error) >= {"message", "type", "param", "code"}
        assert "rlgate_" not in refused.text
    assert ok.status_code == 200
    assert "rlgate_http_requests_total" in ok.text


def test_public_metrics_name_no_run(gateway_launcher, tmp_path: Path) -> None:
    # a per-backend overload limit: its limiter's scope names the run (backend:<run id>)
    server = gateway_launcher(
        tmp_path / "data", metrics_public=True, overload_max_inflight_per_backend=8
    )
    try:
        run = server.create_run("public-metrics")
        for _ in range(3):
            _chat(run)
        public = httpx.get(server.url + "/metrics", timeout=30)
        admin = httpx.get(server.url + "/metrics", headers=server.admin_headers(), timeout=30)
    finally:
        stop(server.proc)
    assert public.status_code == 200
    assert run["run_id"] not in public.text and "run_id" not in public.text
    assert _samples(public.text, "rlgate_completions_total") == {"": 3.0}  # summed over runs
    assert _samples(admin.text, "rlgate_completions_total") == {run["run_id"]: 3.0}
    assert f'scope="backend:{run["run_id"]}"' in admin.text
    assert 'scope="process"' in public.text


async def test_a_scrape_runs_no_sql_and_counts_what_was_stored(
    tmp_path: Path, model_cache_dir: Path, tiny_model_dir: Path
) -> None:
    """The counters equal the store's sums after N captured completions, and the scrape's
    own request executes no SQL statement at all (so its cost does not grow with the tables).

    Statements are told apart by the task that ran them: uvicorn runs each request in a
    task of its own (`RequestResponseCycle.run_asgi`); the leader, weight sync and capture
    writer loops run in theirs.
    """
    settings = gateway_settings(tmp_path / "data", model_cache_dir)
    app = create_app(settings)
    seen: list[tuple[str, str]] = []

    def record(_conn, _cursor, statement, *_args) -> None:
        task = asyncio.current_task()
        name = task.get_coro().__qualname__ if task else ""
        seen.append((name, statement))

    with serving_in_thread(app) as url:
        engine = app.state.sessions.kw["bind"].sync_engine
        event.listen(engine, "before_cursor_execute", record)
        created = httpx.post(
            url + "/admin/v1/runs",
            json={"name": "scan", "model": "tiny"},
            headers=ADMIN,
            timeout=60,
        ).json()
        for i in range(5):
            _chat(created, f"question {i}")
        seen.clear()
        text = httpx.get(url + "/metrics", headers=ADMIN, timeout=30).text
        during = [s for task, s in seen if "run_asgi" in task]
        event.remove(engine, "before_cursor_execute", record)
    with sqlite3.connect(settings.data_dir / "rlgate.db") as conn:
        stored = conn.execute(
            "SELECT count(*), sum(length(prompt_token_ids)) / 4, "
            "sum(length(output_token_ids)) / 4 FROM completions"
        ).fetchone()
    rid = created["run_id"]
    assert during == []
    assert _samples(text, "rlgate_completions_total")[rid] == stored[0] == 5
    assert _samples(text, "rlgate_prompt_tokens_total")[rid] == stored[1]
    assert _samples(text, "rlgate_output_tokens_total")[rid] == stored[2]


@pytest.mark.slow
def test_counters_add_up_across_up_workers(tmp_path: Path, model_cache_dir: Path) -> None:
    """Two gateway processes on one port: every scrape, whichever process answers it,
    reports every completion captured by either."""
    stub_port, port = free_port(), free_port()
    stub = start_stub(stub_port, latency_ms=1, tokens=3)
    with fresh_database() as db:
        env = dict(
            os.environ,
            RLGATE_ADMIN_KEY=ADMIN_KEY,
            RLGATE_DEV_MODE="false",
            RLGATE_MODEL_CACHE_DIR=str(model_cache_dir),
            RLGATE_DATABASE_URL=db,
            RLGATE_BROKER_URL="",
            RLGATE_RESULT_BACKEND="",
            RLGATE_METRICS_PUBLIC="false",
        )
        cmd = [sys.executable, "-m", "rlgate.cli", "up", "--workers", "2", "--no-worker"]
        cmd += ["--port", str(port), "--data-dir", str(tmp_path / "data")]
        log = tmp_path / "up.log"
        up = subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, up, timeout_s=180)
            run = httpx.post(
                url + "/admin/v1/runs",
                json={
                    "name": "w",
                    "model": "tiny",
                    "backend": "vllm",
                    "replicas": [f"http://127.0.0.1:{stub_port}"],
                    "config": {"max_pending_episodes": 10**6},
                },
                headers=ADMIN,
                timeout=120,
            )
            assert run.status_code == 201, run.text
            run = run.json()
            for i in range(16):  # fresh connections: they land on either process
                _chat(run, f"q{i}")
            with psycopg.connect(db) as conn:
                n, prompt, output = conn.execute(
                    "SELECT count(*), sum(length(prompt_token_ids)) / 4, "
                    "sum(length(output_token_ids)) / 4 FROM completions"
                ).fetchone()
            assert n == 16
            answered: dict[int, dict[str, float]] = {}
            deadline = time.monotonic() + 60
            while len(answered) < 2 and time.monotonic() < deadline:
                text = httpx.get(url + "/metrics", headers=ADMIN, timeout=30).text
                pid = int(re.search(r'rlgate_scheduler_leader\{pid="(\d+)"\}', text).group(1))
                answered[pid] = {
                    name: _samples(text, name).get(run["run_id"], 0.0)
                    for name in (
                        "rlgate_completions_total",
                        "rlgate_prompt_tokens_total",
                        "rlgate_output_tokens_total",
                    )
                }
        finally:
            stop(up)
            stop(stub)
    assert len(answered) == 2, "one process answered every scrape"
    expected = {
        "rlgate_completions_total": 16.0,
        "rlgate_prompt_tokens_total": float(prompt),
        "rlgate_output_tokens_total": float(output),
    }
    for pid, counters in answered.items():
        assert counters == expected, (pid, counters, log.read_text()[-3000:])
