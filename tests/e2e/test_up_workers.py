"""`rlgate up --workers 2`: two gateway processes on one port over PostgreSQL and Redis.

One of them leads (schedules training); SIGKILLed, the other takes over and
schedules the next step. Each hot-swaps its own backend clients when a new
version commits. The processes stop with `rlgate up` however it is stopped.

The run's inference server is `inference.stub_server` (vLLM's HTTP API, no
GPU); no trainer worker runs (`--no-worker`): the test commits what a
finished train step commits (checkpoint row, version bump), as
tests/integration/test_failover.py does.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
import redis

from rlgate.stack import free_port, stop, wait_healthy
from tests.faults.load_agents import start_stub
from tests.integration.conftest import fresh_database
from tests.procs import alive, children_of

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REDIS = "redis://127.0.0.1:6379/0"
ADMIN = "workers-admin"


@pytest.fixture
def pg_url() -> Iterator[str]:
    with fresh_database() as url:
        yield url


@pytest.fixture
def queue() -> Iterator[str]:
    name = "rlgate-workers-" + uuid.uuid4().hex[:8]  # a queue no other worker consumes
    yield name
    redis.Redis.from_url(REDIS).delete(name)


def _up(tmp_path: Path, model_cache_dir: Path, db: str, queue: str, port: int):
    env = dict(
        os.environ,
        RLGATE_ADMIN_KEY=ADMIN,
        RLGATE_DEV_MODE="false",
        RLGATE_MODEL_CACHE_DIR=str(model_cache_dir),
        RLGATE_DATABASE_URL=db,
        RLGATE_BROKER_URL=REDIS,
        RLGATE_QUEUE_NAME=queue,
        RLGATE_LEADER_INTERVAL_S="0.5",
        RLGATE_SYNC_INTERVAL_S="0.2",
    )
    cmd = [sys.executable, "-m", "rlgate.cli", "up", "--workers", "2", "--no-worker"]
    cmd += ["--port", str(port), "--data-dir", str(tmp_path / "data")]
    log = tmp_path / "up.log"
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    return proc, log


def _gateways(up: subprocess.Popen) -> list[int]:
    """The gateway processes of `up` (uvicorn's workers; not its resource tracker)."""
    return [
        pid
        for pid in children_of(up.pid)
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]


def _wait(what: str, predicate, timeout_s: float = 60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _leaders(log: Path) -> list[int]:
    return [int(p) for p in re.findall(r"gateway process (\d+) leads", log.read_text())]


def _enqueued(log: Path, step: int) -> list[int]:
    """Pids (the log format's second field) of the processes that enqueued `step`."""
    text = log.read_text()
    return [
        int(p) for p in re.findall(rf"^\S+ \S+ (\d+) \S+ INFO enqueued step {step} ", text, re.M)
    ]


def _swapped(log: Path, run_id: str, version: int) -> set[int]:
    pattern = rf"^\S+ \S+ (\d+) \S+ INFO run {run_id} now serves version {version}$"
    return {int(p) for p in re.findall(pattern, log.read_text(), re.M)}


def _scrape(url: str) -> tuple[int, bool, dict[str, float]]:
    """One /metrics answer on a fresh connection: (pid, leads, served version per run)."""
    auth = {"Authorization": f"Bearer {ADMIN}"}
    text = httpx.get(url + "/metrics", headers=auth, timeout=30).text
    pid, leads = map(int, re.search(r'rlgate_scheduler_leader\{pid="(\d+)"\} (\d)', text).groups())
    served = dict(re.findall(r'rlgate_served_version\{run_id="([^"]+)"\} (\S+)', text))
    return pid, bool(leads), {r: float(v) for r, v in served.items()}


def _group(url: str, run: dict, group: str) -> None:
    """Two rewarded episodes of one group with different rewards: a batch for a step."""
    auth = {"Authorization": f"Bearer {run['api_key']}"}
    for i, reward in enumerate((0.0, 1.0)):
        base = f"{url}/groups/{group}/episodes/{group}-{i}/v1"
        body = {"model": run["name"], "messages": [{"role": "user", "content": "hi"}]}
        # generous timeouts: a process's first call of a new run may wait for it to load
        # (its tokenizer; seconds on a loaded CI machine), which is not what is tested here
        resp = httpx.post(
            base + "/chat/completions", json=body | {"max_tokens": 4}, headers=auth, timeout=60
        )
        assert resp.status_code == 200, resp.text
        reward_body = {"episode_id": f"{group}-{i}", "reward": reward}
        resp = httpx.post(base + "/rewards", json=reward_body, headers=auth, timeout=60)
        assert resp.status_code in (200, 201), resp.text


def _commit_step(db: str, run_id: str, step: int, ckpt: Path) -> None:
    """What the trainer commits when step `step` finishes: version step + 1 with its checkpoint."""
    with psycopg.connect(db, autocommit=False) as conn:
        conn.execute(
            "UPDATE train_steps SET status = 'done' WHERE run_id = %s AND step = %s",
            (run_id, step),
        )
        conn.execute(
            "UPDATE episodes SET status = 'trained' WHERE run_id = %s AND train_step = %s",
            (run_id, step),
        )
        conn.execute(
            "INSERT INTO policy_versions (run_id, version, checkpoint_path, created_at) "
            "VALUES (%s, %s, %s, now())",
            (run_id, step + 1, str(ckpt)),
        )
        conn.execute("UPDATE runs SET current_version = %s WHERE id = %s", (step + 1, run_id))


def test_the_leader_killed_another_schedules_and_every_process_swaps(
    tmp_path, model_cache_dir, tiny_model_dir, pg_url, queue
) -> None:
    stub_port, port = free_port(), free_port()
    stub = start_stub(stub_port, latency_ms=5, tokens=4)
    up, log = _up(tmp_path, model_cache_dir, pg_url, queue, port)
    url = f"http://127.0.0.1:{port}"
    admin = {"Authorization": f"Bearer {ADMIN}"}
    try:
        wait_healthy(url, up, timeout_s=180)
        first = _wait(
            "two gateway processes", lambda: len(g := _gateways(up)) == 2 and g, timeout_s=180
        )
        local = httpx.post(
            url + "/admin/v1/runs",
            json={"name": "local", "model": "tiny", "backend": "local"},
            headers=admin,
            timeout=120,
        )
        assert local.status_code == 400 and local.json()["error"]["code"] == "in_process_backend"
        run = httpx.post(
            url + "/admin/v1/runs",
            json={
                "name": "w",
                "model": "tiny",
                "backend": "vllm",
                "replicas": [f"http://127.0.0.1:{stub_port}"],
                # calls outside the groups below would fill admission's small cap: lifted
                "config": {
                    "group_size": 2,
                    "groups_per_step": 1,
                    "micro_batch_size": 2,
                    "max_pending_episodes": 10**6,
                },
            },
            headers=admin,
            timeout=120,
        )
        assert run.status_code == 201, run.text
        run = run.json()
        run_id = run["run_id"]
        leader = _wait("a leader", lambda: _leaders(log))[0]
        assert leader in first and _leaders(log) == [leader]  # exactly one leads

        _group(url, run, "g0")
        _wait("step 0 enqueued", lambda: _enqueued(log, 0))
        assert set(_enqueued(log, 0)) == {leader}  # only the leader schedules

        os.kill(leader, signal.SIGKILL)
        survivor = next(p for p in first if p != leader)
        taken = _wait("a new leader", lambda: [p for p in _leaders(log) if p != leader])
        assert alive(survivor) and taken[0] != leader
        new_leader = taken[0]

        # Both live processes serve the run before the next version commits.
        gateways = _wait("uvicorn's replacement", lambda: len(g := _gateways(up)) == 2 and g)

        def both_loaded() -> bool:
            seen = {}
            for _ in range(12):  # fresh connections land on either process
                httpx.post(
                    run["base_url"] + "/chat/completions",
                    json={"model": "w", "messages": [{"role": "user", "content": "x"}]},
                    headers={"Authorization": f"Bearer {run['api_key']}"},
                    timeout=60,
                )
                pid, _, served = _scrape(url)
                seen[pid] = run_id in served
            return all(seen.get(p) for p in gateways)

        _wait("the run loaded in both processes", both_loaded, timeout_s=120)
        ckpt = tmp_path / "ckpt-v1"
        shutil.copytree(tiny_model_dir, ckpt)
        _commit_step(pg_url, run_id, 0, ckpt)
        _wait("both processes swapped", lambda: _swapped(log, run_id, 1) >= set(gateways))
        assert _swapped(log, run_id, 1) == set(gateways)
        state = httpx.get(f"http://127.0.0.1:{stub_port}/stub/state").json()
        assert state["reloads"] == 1 and state["weights_path"] == str(ckpt)  # one for both

        _group(url, run, "g1")  # the new leader schedules the next step
        assert set(_wait("step 1 enqueued", lambda: _enqueued(log, 1))) == {new_leader}
    finally:
        stop(up)
        stop(stub)
    assert "unhandled error" not in log.read_text()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=str)
def test_up_workers_stop_with_it(tmp_path, model_cache_dir, pg_url, queue, sig) -> None:
    up, _ = _up(tmp_path, model_cache_dir, pg_url, queue, port := free_port())
    try:
        wait_healthy(f"http://127.0.0.1:{port}", up, timeout_s=180)
        gateways = _wait("two gateway processes", lambda: len(g := _gateways(up)) == 2 and g)
        up.send_signal(sig)
        up.wait(60)
        _wait("the gateways to stop", lambda: not any(alive(p) for p in gateways), 60)
        if sig != signal.SIGKILL:
            assert up.returncode in (0, 128 + sig, -sig), up.returncode
    finally:
        stop(up)
        for pid in children_of(up.pid):
            os.kill(pid, signal.SIGKILL)
