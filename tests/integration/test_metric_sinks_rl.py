"""W&B and MLflow after a short real RL run: what the trackers hold equals the step rows.

Real processes: a uvicorn gateway and a Celery worker on Redis, the offline
`tiny` model, agents on the official `openai` client. The worker is stopped
and started again before every step, as a deploy would: the trackers must
find their run again, not start one per worker. W&B runs offline and is read
back from its `.wandb` files; MLflow writes to a SQLite store in the test's
directory. The third worker's MLflow server refuses connections: that step
must still be done, its version served, and its row must count the failure.
"""

from __future__ import annotations

import math
import socket
import uuid

import pytest
from wandb import teardown as wandb_teardown

from core.settings import Settings
from rlgate.stack import free_port, start_gateway, start_worker, stop, wait_healthy
from tests.integration.conftest import Stack
from tests.integration.test_rl_loop import _play_two_groups, _wait_served
from tests.wandb_records import offline_runs

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ADMIN_KEY = "sinks-admin-key"
EXPERIMENT = "rlgate-it"


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed again on return: nobody listens there


def _logged(row: dict) -> dict[str, float]:
    """What the trainer hands its sinks for a step: the row's scalar metrics and columns.

    `sink_errors` is written after the sinks ran, so no sink ever sees it.
    """
    scalars = {
        k: v
        for k, v in row["metrics"].items()
        if isinstance(v, int | float) and not isinstance(v, bool) and k != "sink_errors"
    }
    return scalars | {k: row[k] for k in ("reward_mean", "reward_std", "duration_s")}


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def test_wandb_and_mlflow_hold_the_step_rows_and_a_failing_sink_leaves_the_step_done(
    redis_url, model_cache, tmp_path, monkeypatch
) -> None:
    from mlflow import MlflowClient

    wandb_dir = tmp_path / "wandb"
    monkeypatch.setenv("WANDB_MODE", "offline")  # the worker inherits this environment
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    # W&B keeps the settings of its first run in the process (its dir among them)
    wandb_teardown()
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the refusing server: no backoff
    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    settings = Settings(
        data_dir=tmp_path / "data",
        broker_url=redis_url,
        queue_name=f"train-sinks-{uuid.uuid4().hex[:8]}",
        admin_key=ADMIN_KEY,
        dev_mode=False,
        model_cache_dir=model_cache,
        metrics_wandb_project="rlgate-it",  # W&B for every run of this worker
        metrics_mlflow_tracking_uri=mlflow_uri,  # MLflow only where a run asks for it
    )
    refusing = settings.model_copy(
        update={"metrics_mlflow_tracking_uri": f"http://127.0.0.1:{_closed_port()}"}
    )
    port = free_port()
    gateway = start_gateway(settings, "127.0.0.1", port, tmp_path / "gateway.log")
    stack = Stack(f"http://127.0.0.1:{port}", ADMIN_KEY, settings)
    try:
        wait_healthy(stack.url, gateway, timeout_s=120)
        with stack.admin() as admin:
            r = admin.post(
                "/admin/v1/runs",
                json={
                    "name": "it",  # the model name _play_two_groups asks for
                    "model": "tiny",
                    "config": {
                        "group_size": 2,
                        "groups_per_step": 2,
                        "micro_batch_size": 2,
                        "tracking": {"mlflow_experiment": EXPERIMENT},
                    },
                },
            )
            assert r.status_code == 201, r.text
            run = r.json()
        root = run["base_url"].removesuffix("/v1")
        for step, worker_settings in enumerate([settings, settings, refusing]):
            worker = start_worker(worker_settings, tmp_path / f"worker-{step}.log")
            try:
                _play_two_groups(root, run["api_key"], version=step)
                _wait_served(stack, run["run_id"], step + 1)
            finally:
                # Version N is served once committed, maybe before the step's sinks ran: a
                # warm shutdown lets the task finish them, then the worker closes its trackers.
                stop(worker, timeout_s=180)
        with stack.admin() as admin:
            rows = admin.get(f"/admin/v1/runs/{run['run_id']}/steps").json()
    finally:
        stop(gateway)

    assert [(r["step"], r["status"], r["version"]) for r in rows] == [
        (0, "done", 1),
        (1, "done", 2),
        (2, "done", 3),  # MLflow refused, the step counted all the same
    ]
    assert [r["metrics"].get("sink_errors") for r in rows] == [None, None, 1]
    expected = {r["version"]: _logged(r) for r in rows}

    # W&B: one run, id = the rlgate run id, opened by each of the three workers; config logged
    runs = offline_runs(wandb_dir, run["run_id"])
    assert len(runs) == 3
    assert {(w.run_id, w.project) for w in runs} == {(run["run_id"], "rlgate-it")}
    for w in runs:
        assert w.config["rlgate_run_id"] == run["run_id"] and w.config["group_size"] == 2
        assert w.config["tracking"]["mlflow_experiment"] == EXPERIMENT
    history = [row for w in runs for row in w.history]
    assert [row["_step"] for row in history] == [1, 2, 3]  # step = the version produced
    for row in history:
        want = expected[row["_step"]]
        assert {k for k in row if k.startswith("train/")} == {f"train/{k}" for k in want}
        assert all(_same(row[f"train/{k}"], v) for k, v in want.items()), (row, want)

    # MLflow: one run found again by its tag; versions 1 and 2 (the third worker's was refused)
    client = MlflowClient(tracking_uri=mlflow_uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    (mlflow_run,) = client.search_runs([experiment.experiment_id])
    assert mlflow_run.data.tags["rlgate.run_id"] == run["run_id"]
    assert mlflow_run.data.params["group_size"] == "2"
    assert set(mlflow_run.data.metrics) == {f"train/{k}" for k in expected[1]}
    for key in expected[1]:
        history = client.get_metric_history(mlflow_run.info.run_id, f"train/{key}")
        points = sorted((m.step, m.value) for m in history)
        assert [step for step, _ in points] == [1, 2], key
        assert all(_same(value, expected[step][key]) for step, value in points), (key, points)
