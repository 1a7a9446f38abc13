"""Redis restarted in the middle of training: the lost step is resent and runs once.

The test starts its OWN redis-server on a free port (no persistence, so the
restart loses the queued task, the worst case) and never touches the shared
one. The worker starts only once Redis is down, so no worker can have taken
the step's message before it was lost: the step can only run if the gateway
resends it (a step that stays quiet for `step_timeout_s`). Redis then restarts
once more under the connected worker, and the next step runs. The version
must advance exactly once per step.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis

from rlgate.stack import free_port, start_worker, stop
from tests.faults.conftest import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _redis(port: int) -> subprocess.Popen:
    binary = shutil.which("redis-server") or "redis-server"
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--save", "", "--appendonly", "no", "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port, socket_connect_timeout=1)
    wait_for(lambda: _pings(client), 20, "redis-server to start")
    return proc


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


@pytest.fixture
def own_redis() -> Iterator[dict]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server must be installed for the fault suite")
    port = free_port()
    state = {"port": port, "proc": _redis(port)}
    yield state
    state["proc"].kill()
    state["proc"].wait(10)


def _group(run: dict, group: str) -> None:
    root = run["base_url"].removesuffix("/v1")
    for e, reward in enumerate((0.0, 1.0)):
        client = openai.OpenAI(
            base_url=f"{root}/groups/{group}/episodes/{group}-{e}/v1", api_key=run["api_key"]
        )
        resp = client.chat.completions.create(
            model=run["name"], messages=[{"role": "user", "content": "2 + 2?"}], max_tokens=6
        )
        client.post("/rewards", body={"completion_id": resp.id, "reward": reward}, cast_to=object)


def test_redis_restart_mid_training_step_runs_once(make_gateway, own_redis, tmp_path) -> None:
    broker = f"redis://127.0.0.1:{own_redis['port']}/0"
    queue = "faults-redis"
    gw = make_gateway(broker_url=broker, queue_name=queue, step_timeout_s=6.0, sync_interval_s=0.3)
    worker = None
    admin = gw.admin()

    def info() -> dict:
        return admin.get(f"/admin/v1/runs/{run['run_id']}").json()

    def steps() -> list[tuple[int, str]]:
        return [
            (s["step"], s["status"])
            for s in admin.get(f"/admin/v1/runs/{run['run_id']}/steps").json()
        ]

    try:
        run = gw.create_run(
            "redis",
            {"group_size": 2, "groups_per_step": 1, "micro_batch_size": 2, "max_staleness": 1},
        )
        _group(run, "g0")
        # the step's message is in Redis and no worker exists to take it: Redis goes away with
        # it, and comes back empty
        broker_client = redis.Redis(port=own_redis["port"], socket_connect_timeout=1)
        wait_for(lambda: broker_client.llen(queue) == 1, 30, "step 0's message in Redis")
        broker_client.close()
        own_redis["proc"].kill()
        own_redis["proc"].wait(10)
        assert steps() == [(0, "queued")] and info()["current_version"] == 0
        worker = start_worker(gw.settings, tmp_path / "worker.log")  # retries until Redis is back
        time.sleep(2)
        own_redis["proc"] = _redis(own_redis["port"])
        wait_for(lambda: info()["current_version"] == 1, 150, "version 1 after the restart")
        assert steps() == [(0, "done")]
        (step0,) = admin.get(f"/admin/v1/runs/{run['run_id']}/steps").json()
        assert step0["metrics"]["resent"] >= 1  # only a resend could have brought it back
        # Redis restarts again, now under a connected worker: both ends reconnect, training goes
        # on, and nothing runs twice
        own_redis["proc"].kill()
        own_redis["proc"].wait(10)
        time.sleep(2)
        own_redis["proc"] = _redis(own_redis["port"])
        _group(run, "g1")
        wait_for(lambda: info()["current_version"] == 2, 150, "version 2")
        time.sleep(8)  # past step_timeout_s: a resend of a finished step must change nothing
        assert info()["current_version"] == 2
        assert steps() == [(0, "done"), (1, "done")]
    except (AssertionError, httpx.HTTPError):
        print(gw.log_text()[-3000:])
        print((tmp_path / "worker.log").read_text(errors="replace")[-3000:])
        raise
    finally:
        admin.close()
        if worker is not None:
            stop(worker)
