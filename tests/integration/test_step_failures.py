"""A train step that keeps failing: retried up to the attempt limit, then the run is failed.

Real processes: a gateway and a Celery worker on a real Redis queue, sharing one
SQLite store. The worker's data directory holds a plain file where its
`checkpoints` folder should be, so every attempt loads the batch and the model
and then fails to write version 1 (a disk the trainer cannot write to).
"""

from __future__ import annotations

import re
import sqlite3
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from core.settings import Settings
from gateway.control.scheduler import MAX_ATTEMPTS
from rlgate.stack import free_port, start_gateway, start_worker, stop, wait_healthy

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ADMIN_KEY = "step-failure-admin"
CONFIG = {"group_size": 2, "groups_per_step": 1, "micro_batch_size": 2}


@dataclass
class FailingStack:
    url: str
    db: Path
    worker_log: Path
    gateway_log: Path

    def admin(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60
        )

    def query(self, sql: str, params: tuple = ()) -> list[tuple]:
        conn = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=10)
        try:
            return conn.execute(sql, params).fetchall()
        finally:
            conn.close()


@pytest.fixture(scope="module")
def stack(
    redis_url: str, model_cache_dir: Path, tiny_model_dir: Path, tmp_path_factory
) -> Iterator[FailingStack]:
    tmp = tmp_path_factory.mktemp("step-failures")
    common: dict[str, Any] = {
        "database_url": f"sqlite:///{tmp / 'gateway' / 'rlgate.db'}",
        "broker_url": redis_url,
        "result_backend": "",
        "queue_name": f"fail-{tmp.name}",
        "admin_key": ADMIN_KEY,
        "dev_mode": False,
        "model_cache_dir": model_cache_dir,
        "public_url": "",
        "sync_interval_s": 0.2,
    }
    gateway = Settings(data_dir=tmp / "gateway", **common)
    worker = Settings(data_dir=tmp / "worker", **common)
    worker.data_dir.mkdir(parents=True)
    gateway.data_dir.mkdir(parents=True)
    worker.checkpoints_dir.write_text("not a directory\n")  # every checkpoint write fails
    port = free_port()
    w = start_worker(worker, tmp / "worker.log")
    g = start_gateway(gateway, "127.0.0.1", port, tmp / "gateway.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, g, timeout_s=120)
        yield FailingStack(
            url, tmp / "gateway" / "rlgate.db", tmp / "worker.log", tmp / "gateway.log"
        )
    finally:
        stop(g)
        stop(w)


def _wait(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def failed_run(stack: FailingStack) -> dict:
    """A run whose one ready group has failed its step MAX_ATTEMPTS times."""
    with stack.admin() as admin:
        r = admin.post("/admin/v1/runs", json={"name": "doomed", "model": "tiny", "config": CONFIG})
        assert r.status_code == 201, r.text
        run = r.json()
        root = run["base_url"].removesuffix("/v1")
        for e, reward in enumerate((0.0, 1.0)):
            client = openai.OpenAI(
                base_url=f"{root}/groups/g/episodes/ep-{e}/v1",
                api_key=run["api_key"],
                max_retries=0,
            )
            done = client.chat.completions.create(
                model=run["name"], messages=[{"role": "user", "content": "2 + 2?"}], max_tokens=4
            )
            client.post(
                "/rewards", body={"completion_id": done.id, "reward": reward}, cast_to=object
            )

        def failed() -> dict | None:
            info = admin.get(f"/admin/v1/runs/{run['run_id']}").json()
            return info if info["status"] == "failed" else None

        try:
            _wait(failed, 240, "the run to be marked failed")
        except AssertionError:
            steps = admin.get(f"/admin/v1/runs/{run['run_id']}/steps").json()
            raise AssertionError(
                f"steps: {steps}\n{stack.worker_log.read_text()[-3000:]}"
            ) from None
    return run


def _failures_logged(stack: FailingStack, run_id: str) -> int:
    pattern = re.compile(rf"step 0 of run {re.escape(run_id)} failed")
    return len(pattern.findall(stack.worker_log.read_text(errors="replace")))


def test_the_step_is_tried_max_attempts_times_then_the_run_fails(
    stack: FailingStack, failed_run: dict
) -> None:
    rid = failed_run["run_id"]
    with stack.admin() as admin:
        info = admin.get(f"/admin/v1/runs/{rid}").json()
        steps = admin.get(f"/admin/v1/runs/{rid}/steps").json()
        versions = admin.get(f"/admin/v1/runs/{rid}/versions").json()
    assert info["status"] == "failed" and info["current_version"] == 0
    # one step row, retried under the same number, its attempts counted
    assert [(s["step"], s["status"]) for s in steps] == [(0, "failed")]
    assert steps[0]["metrics"]["attempts"] == MAX_ATTEMPTS == 3
    assert "NotADirectoryError" in steps[0]["error"]
    assert _failures_logged(stack, rid) == MAX_ATTEMPTS
    # nothing of a failed attempt is kept: no version, no checkpoint
    assert [v["version"] for v in versions] == [0]
    assert stack.query("SELECT COUNT(*) FROM policy_versions WHERE run_id = ?", (rid,)) == [(1,)]


def test_its_episodes_are_handed_back_as_rewarded(stack: FailingStack, failed_run: dict) -> None:
    rows = stack.query(
        "SELECT id, status, train_step, reward FROM episodes WHERE run_id = ? ORDER BY id",
        (failed_run["run_id"],),
    )
    assert rows == [("ep-0", "rewarded", None, 0.0), ("ep-1", "rewarded", None, 1.0)]
    with stack.admin() as admin:
        counts = admin.get(f"/admin/v1/runs/{failed_run['run_id']}/counters").json()
    assert counts["episodes_by_status"] == {"rewarded": 2}


def test_nothing_more_is_scheduled_and_agents_are_told(
    stack: FailingStack, failed_run: dict
) -> None:
    rid = failed_run["run_id"]
    time.sleep(2.0)  # ten scheduler passes
    assert _failures_logged(stack, rid) == MAX_ATTEMPTS
    with stack.admin() as admin:
        steps = admin.get(f"/admin/v1/runs/{rid}/steps").json()
        assert [(s["status"], s["metrics"]["attempts"]) for s in steps] == [("failed", 3)]
        assert admin.get("/admin/v1/workers").json()["pending_steps"] == 0
    resp = httpx.post(
        f"{stack.url}/v1/chat/completions",
        json={"model": "doomed", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"Authorization": f"Bearer {failed_run['api_key']}"},
        timeout=60,
    )
    assert resp.status_code == 429, resp.text
    assert resp.json()["error"]["type"] == "rate_limit_error"
    assert "failed" in resp.json()["error"]["message"]
