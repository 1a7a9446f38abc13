"""Held-out figures in the metrics sinks after a real RL run: the worker logs each version's.

Real processes: a uvicorn gateway and a Celery worker on Redis, the offline `tiny`
model, agents on the official `openai` client; evaluation episodes go through
`/eval`. Evaluation rewards arrive after the step that made their version, and one
is revised later: the worker logs, after each step and when it shuts down, every
version whose figures changed since it last logged them, at x = that version. The
worker is restarted between steps: what it logged is remembered in the store, so
nothing is logged twice. JSON lines, W&B (offline, its companion `-eval` run) and
MLflow (a SQLite store) then hold exactly the same points, and each version's last
point equals the admin API's figures.
"""

from __future__ import annotations

import json
import uuid

import openai
import pytest
from wandb import teardown as wandb_teardown

from core.settings import Settings
from rlgate.stack import free_port, start_gateway, start_worker, stop, wait_healthy
from tests.integration.conftest import Stack
from tests.integration.test_rl_loop import _play_two_groups, _wait_served
from tests.wandb_records import offline_runs

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ADMIN_KEY = "eval-sinks-admin-key"
EXPERIMENT = "rlgate-eval-it"


def _evaluate(root: str, key: str, scores: dict[str, float]) -> None:
    """One evaluation call per episode, then its episode reward."""
    for episode, score in scores.items():
        client = openai.OpenAI(base_url=f"{root}/eval/episodes/{episode}/v1", api_key=key)
        client.chat.completions.create(
            model="it", messages=[{"role": "user", "content": f"held out {episode}"}], max_tokens=4
        )
        _reward(root, key, episode, score)


def _reward(root: str, key: str, episode: str, score: float) -> None:
    client = openai.OpenAI(base_url=f"{root}/v1", api_key=key)
    ack = client.post("/rewards", body={"episode_id": episode, "reward": score}, cast_to=object)
    assert ack["episode_status"] == "eval"


def _points(lines: list[dict]) -> list[tuple[int, int, float, float | None]]:
    return [(x["version"], x["episodes"], x["mean_reward"], x.get("stderr")) for x in lines]


def test_each_version_held_out_figures_reach_every_sink_once_per_change(
    redis_url, model_cache, tmp_path, monkeypatch
) -> None:
    from mlflow import MlflowClient

    wandb_dir = tmp_path / "wandb"
    monkeypatch.setenv("WANDB_MODE", "offline")  # the worker inherits this environment
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    # W&B keeps the settings of its first run in the process (its dir among them)
    wandb_teardown()
    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    settings = Settings(
        data_dir=tmp_path / "data",
        broker_url=redis_url,
        queue_name=f"train-evals-{uuid.uuid4().hex[:8]}",
        admin_key=ADMIN_KEY,
        dev_mode=False,
        model_cache_dir=model_cache,
        metrics_dir=tmp_path / "metrics",
        metrics_wandb_project="rlgate-eval-it",
        metrics_mlflow_tracking_uri=mlflow_uri,
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
                    "name": "it",
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
        run_id, key = run["run_id"], run["api_key"]
        root = run["base_url"].removesuffix("/v1")
        evals = tmp_path / "metrics" / run_id / "evals.jsonl"

        def logged() -> list[dict]:
            return [json.loads(x) for x in evals.read_text().splitlines()] if evals.exists() else []

        # Worker 1: version 0 is evaluated before step 0; the step logs its figures.
        _evaluate(root, key, {"a0": 0.0, "b0": 1.0, "c0": 1.0})
        worker = start_worker(settings, tmp_path / "worker-1.log")
        try:
            _play_two_groups(root, key, version=0)
            _wait_served(stack, run_id, 1)
        finally:
            stop(worker, timeout_s=180)  # warm: the step's sinks run, then the worker closes
        assert [x["version"] for x in logged()] == [0]

        # Worker 2: version 1 evaluated and a version-0 reward revised before step 1; version
        # 2 evaluated after step 1, logged when the worker shuts down.
        _evaluate(root, key, {"a1": 0.25, "b1": 0.75})
        _reward(root, key, "a0", 1.0)
        worker = start_worker(settings, tmp_path / "worker-2.log")
        try:
            _play_two_groups(root, key, version=1)
            _wait_served(stack, run_id, 2)
            _evaluate(root, key, {"a2": 0.5})
        finally:
            stop(worker, timeout_s=180)

        with stack.admin() as admin:
            figures = admin.get(f"/admin/v1/runs/{run_id}/evals").json()["data"]
            info = admin.get(f"/admin/v1/runs/{run_id}").json()
            steps = admin.get(f"/admin/v1/runs/{run_id}/steps").json()
    finally:
        stop(gateway)

    assert [(s["step"], s["status"], s["metrics"].get("sink_errors")) for s in steps] == [
        (0, "done", None),
        (1, "done", None),
    ]
    api = {
        f["version"]: (f["version"], f["episodes"], f["mean_reward"], f["stderr"]) for f in figures
    }
    assert sorted(api) == [0, 1, 2]
    points = _points(logged())
    # version 0 at step 0, again once revised (at step 1) beside version 1; version 2 at close
    assert [p[0] for p in points] == [0, 0, 1, 2]
    assert points[0][1:3] == (3, 2 / 3)
    assert points[1:] == [api[0], api[1], api[2]]
    assert info["counters"]["eval_logged"] == {str(v): list(api[v][1:]) for v in api}

    # W&B: the train run's steps are the versions, untouched; its `-eval` companion has the
    # same points as the JSON lines, in the same order, one directory per worker
    train = [row for w in offline_runs(wandb_dir, run_id) for row in w.history]
    assert [row["_step"] for row in train] == [1, 2]
    companion = offline_runs(wandb_dir, f"{run_id}-eval")
    assert len(companion) == 2 and {w.project for w in companion} == {"rlgate-eval-it"}
    rows = [row for w in companion for row in w.history]
    wandb_points = [
        (r["eval/version"], r["eval/episodes"], r["eval/mean_reward"], r.get("eval/stderr"))
        for r in rows
    ]
    assert wandb_points == points

    # MLflow: the same points in the run's own MLflow run, at step = the version
    client = MlflowClient(tracking_uri=mlflow_uri)
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id])
    history = client.get_metric_history(mlflow_run.info.run_id, "eval/mean_reward")
    assert sorted((m.step, m.value) for m in history) == sorted((p[0], p[2]) for p in points)
