"""The thread budget reaches both processes: the gateway's local backend and the train worker.

Real uvicorn gateway, real Celery worker on Redis, the plain `openai` client;
one train step on the `tiny` model. The budget is left at its default, derived
from the cores: on a machine with more than one core that differs from torch's
own default (every core), so a process that ignored it would fail here.
"""

from __future__ import annotations

import time

import openai
import pytest

from core.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_gateway_and_worker_run_on_their_thread_budgets(redis_url, model_cache, tmp_path) -> None:
    from tests.integration.conftest import running_stack

    settings = Settings(
        data_dir=tmp_path / "data",
        broker_url=redis_url,
        queue_name=f"train-{tmp_path.name}",
        admin_key="it-admin-key",
        dev_mode=False,
        model_cache_dir=model_cache,
    )
    budget = settings.threads()
    with running_stack(settings, tmp_path) as stack:
        with stack.admin() as admin:
            r = admin.post(
                "/admin/v1/runs",
                json={
                    "name": "threads",
                    "model": "tiny",
                    "config": {"group_size": 2, "groups_per_step": 1, "micro_batch_size": 2},
                },
            )
            assert r.status_code == 201, r.text
            run = r.json()
        root = run["base_url"].removesuffix("/v1")
        for e in range(2):
            client = openai.OpenAI(
                base_url=f"{root}/groups/g0/episodes/e{e}/v1", api_key=run["api_key"]
            )
            resp = client.chat.completions.create(
                model="threads", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            client.post("/rewards", body={"completion_id": resp.id, "reward": e}, cast_to=object)

        with stack.admin() as admin:
            threads = admin.get("/admin/v1/workers").json()["threads"]
            assert threads["cores"] == budget.cores
            assert threads["backend_threads"] == budget.backend
            assert threads["trainer_threads"] == budget.trainer
            # measured inside the thread that runs the gateway's model
            assert threads["backends"] == {run["run_id"]: budget.backend}

            deadline = time.monotonic() + 180
            steps: list = []
            while time.monotonic() < deadline:
                steps = admin.get(f"/admin/v1/runs/{run['run_id']}/steps").json()
                if steps and steps[0]["status"] in ("done", "failed"):
                    break
                time.sleep(0.3)
        assert [s["status"] for s in steps] == ["done"], steps
        # measured inside the worker process, in the thread that ran the step
        assert steps[0]["metrics"]["torch_threads"] == budget.trainer
