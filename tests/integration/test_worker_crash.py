"""kill -9 of the Celery worker in the middle of a train step (real Redis, real processes).

The model is SmolLM2-135M so that a step lasts long enough (seconds) to be killed in.
After a new worker starts, the gateway resends the quiet step (`step_timeout_s`), the
version advances exactly once, and training goes on.
"""

from __future__ import annotations

import os
import signal
import time

import openai
import pytest

from core.settings import Settings
from rlgate.stack import free_port, start_gateway, start_worker, stop, wait_healthy

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _steps(admin, run_id: str) -> list[dict]:
    return admin.get(f"/admin/v1/runs/{run_id}/steps").json()


def _wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _group(run: dict, root: str, group: str) -> None:
    for e, reward in enumerate((0.0, 1.0)):
        client = openai.OpenAI(
            base_url=f"{root}/groups/{group}/episodes/{group}-{e}/v1", api_key=run["api_key"]
        )
        resp = client.chat.completions.create(
            model=run["name"],
            messages=[{"role": "user", "content": "What is 2 + 2?"}],
            max_tokens=12,
        )
        client.post("/rewards", body={"completion_id": resp.id, "reward": reward}, cast_to=object)


@pytest.mark.timeout(1200)  # its own deadlines add up to about 12 minutes
def test_killed_worker_step_reruns_and_bumps_once(redis_url, smollm2_cache, tmp_path) -> None:
    import httpx

    settings = Settings(
        data_dir=tmp_path / "data",
        broker_url=redis_url,
        queue_name=f"crash-{tmp_path.name}",
        admin_key="crash-admin",
        dev_mode=False,
        model_cache_dir=smollm2_cache,
        step_timeout_s=8.0,
        sync_interval_s=0.5,
    )
    port = free_port()
    worker = start_worker(settings, tmp_path / "worker1.log")
    gateway = start_gateway(settings, "127.0.0.1", port, tmp_path / "gateway.log")
    url = f"http://127.0.0.1:{port}"
    second = None
    admin = httpx.Client(base_url=url, headers={"Authorization": "Bearer crash-admin"}, timeout=300)
    try:
        wait_healthy(url, gateway)
        run = admin.post(
            "/admin/v1/runs",
            json={
                "name": "crash",
                "model": "smollm2",
                "config": {
                    "group_size": 2,
                    "groups_per_step": 1,
                    "micro_batch_size": 2,
                    "max_staleness": 1,
                },
            },
        ).json()
        root = run["base_url"].removesuffix("/v1")
        _group(run, root, "g0")
        _wait(
            lambda: any(s["status"] == "running" for s in _steps(admin, run["run_id"])),
            120,
            "step 0 to start",
        )
        os.kill(worker.pid, signal.SIGKILL)  # mid-step
        worker.wait(10)
        time.sleep(2)
        info = admin.get(f"/admin/v1/runs/{run['run_id']}").json()
        assert info["current_version"] == 0, "a killed step must not have bumped the version"
        second = start_worker(settings, tmp_path / "worker2.log")
        _wait(
            lambda: admin.get(f"/admin/v1/runs/{run['run_id']}").json()["served_version"] == 1,
            240,
            "version 1 after the restart",
        )
        steps = _steps(admin, run["run_id"])
        assert [(s["step"], s["status"]) for s in steps] == [(0, "done")]
        assert steps[0]["metrics"]["resent"] >= 1
        # training goes on from the new version
        _group(run, root, "g1")
        _wait(
            lambda: admin.get(f"/admin/v1/runs/{run['run_id']}").json()["served_version"] == 2,
            240,
            "version 2",
        )
        # a duplicate delivery of step 0 (as Redis redelivers an unacked task) changes nothing
        from trainer.celery_app import make_celery
        from trainer.submit import submit_train_step

        celery = make_celery(settings.queue())
        # Celery never overwrites a successful result, and a duplicate has the first delivery's
        # task id (one per (run, step), see submit_train_step): drop that result first, so the
        # result awaited below can only be the duplicate's.
        first = celery.AsyncResult(f"{run['run_id']}-step-0")
        assert first.state == "SUCCESS"
        first.forget()
        task_id = submit_train_step(celery, run["run_id"], 0)
        assert task_id == first.id
        assert celery.AsyncResult(task_id).get(timeout=120)["skipped"] is True
        celery.close()
        info = admin.get(f"/admin/v1/runs/{run['run_id']}").json()
        assert info["current_version"] == 2
        assert [s["status"] for s in _steps(admin, run["run_id"])] == ["done", "done"]
    finally:
        admin.close()
        stop(gateway)
        for proc in (worker, second):
            if proc is not None:
                stop(proc)
