"""Held-out figures in the metrics sinks: each sink's points read back, and what the trainer
logs after a step (`trainer.eval_metrics`) against a real store, across a worker restart."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

import pytest
from sqlalchemy.orm import sessionmaker
from wandb import teardown as wandb_teardown

from core.store.db import make_sync_engine
from core.store.evals import EvalFigures
from core.store.migrate import upgrade
from core.store.models import Completion, Episode, Run
from tests.wandb_records import offline_runs, records
from trainer.config import RunConfig, TrackingConfig
from trainer.eval_metrics import LOGGED, changed, log_eval_figures, remembered
from trainer.metrics_sinks import MetricsSinkConfig, TrackedRun, make_sinks

CONFIG = RunConfig(group_size=2, groups_per_step=2, micro_batch_size=2).model_dump()
V1, V2 = EvalFigures(1, 2, 0.5, 0.5), EvalFigures(2, 1, 1.0, None)
V1_REVISED = EvalFigures(1, 2, 0.75, 0.25)
SPANNING = EvalFigures(None, 1, 0.0, None)


def tracked(run_id: str, **tracking) -> TrackedRun:
    return TrackedRun(run_id, "unit-run", "tiny", CONFIG, TrackingConfig(**tracking))


def jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_only_changed_versioned_rows_are_logged_again() -> None:
    logged = remembered([V1, V2, SPANNING])
    assert logged == {"1": [2, 0.5, 0.5], "2": [1, 1.0, None]}  # the spanning row never
    assert changed([V1, V2, SPANNING], {}) == [V1, V2]
    assert changed([V1, V2, SPANNING], json.loads(json.dumps(logged))) == []  # as stored
    assert changed([V1_REVISED, V2], logged) == [V1_REVISED]


def test_jsonl_and_tensorboard_points_at_their_version(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sinks = make_sinks(MetricsSinkConfig(dir=tmp_path, tensorboard=True))
    run = tracked("run_e")
    assert sinks.log(run, 3, {"loss": 0.5}) == 0  # a step at version 3 first
    assert sinks.log_eval(run, [V1, V2]) == 0
    assert sinks.log_eval(run, [V1_REVISED]) == 0  # an older version, later: still its own x
    sinks.close()
    lines = jsonl(tmp_path / "run_e" / "evals.jsonl")
    assert [{k: v for k, v in x.items() if k != "time"} for x in lines] == [
        {"version": 1, "episodes": 2, "mean_reward": 0.5, "stderr": 0.5},
        {"version": 2, "episodes": 1, "mean_reward": 1.0},  # no stderr of one episode
        {"version": 1, "episodes": 2, "mean_reward": 0.75, "stderr": 0.25},
    ]
    assert len(jsonl(tmp_path / "run_e" / "metrics.jsonl")) == 1  # the steps' file apart
    acc = EventAccumulator(str(tmp_path / "tensorboard" / "run_e"))
    acc.Reload()
    means = [(e.step, e.value) for e in acc.Scalars("eval/mean_reward")]
    assert means == [(1, 0.5), (2, 1.0), (1, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/stderr")] == [(1, 0.5), (1, 0.25)]
    assert [e.step for e in acc.Scalars("train/loss")] == [3]


@pytest.mark.slow  # W&B starts its core service
def test_wandb_companion_run_keyed_by_eval_version_beside_the_train_run(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    # W&B keeps the settings of its first run in the process (its dir among them)
    wandb_teardown()
    cfg = MetricsSinkConfig(wandb_project="unit")
    run = tracked("run_w")
    for batch in ([V1, V2], [V1_REVISED]):  # the second MetricsSinks is a restarted worker
        sinks = make_sinks(cfg)
        assert sinks.log(run, 3, {"loss": 0.5}) == 0
        assert sinks.log_eval(run, batch) == 0
        sinks.close()
        time.sleep(1.1)  # W&B names offline directories by the second: one each

    train = offline_runs(tmp_path, "run_w")
    assert [row["_step"] for r in train for row in r.history] == [3, 3]  # untouched by evals
    assert all(not any(k.startswith("eval/") for k in row) for r in train for row in r.history)
    evals = offline_runs(tmp_path, "run_w-eval")
    assert len(evals) == 2 and {(r.run_id, r.project) for r in evals} == {("run_w-eval", "unit")}
    assert all(r.config["rlgate_run_id"] == "run_w" for r in evals)
    rows = [row for r in evals for row in r.history]
    assert [(r["eval/version"], r["eval/mean_reward"], r["eval/episodes"]) for r in rows] == [
        (1, 0.5, 2),
        (2, 1.0, 1),
        (1, 0.75, 2),
    ]
    assert "eval/stderr" not in rows[1]
    for r in sorted((tmp_path / "wandb").glob("offline-run-*-run_w-eval")):
        (log,) = r.glob("*.wandb")
        metrics = [x.metric for x in records(log) if x.WhichOneof("record_type") == "metric"]
        assert ("eval/*", "eval/version") in {(m.glob_name, m.step_metric) for m in metrics}
        (run_record,) = [x.run for x in records(log) if x.WhichOneof("record_type") == "run"]
        assert (run_record.run_group, run_record.job_type) == ("run_w", "eval")


@pytest.mark.slow  # MLflow builds its SQLite schema
def test_mlflow_eval_points_in_the_run_own_mlflow_run(tmp_path) -> None:
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = tracked("run_m", mlflow_experiment="unit")
    sinks = make_sinks(MetricsSinkConfig(mlflow_tracking_uri=uri))
    assert sinks.log(run, 3, {"loss": 0.5}) == 0
    assert sinks.log_eval(run, [V1, V2]) == 0
    assert sinks.log_eval(run, [V1_REVISED]) == 0
    sinks.close()
    client = MlflowClient(tracking_uri=uri)
    (found,) = client.search_runs([client.get_experiment_by_name("unit").experiment_id])
    history = client.get_metric_history(found.info.run_id, "eval/mean_reward")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.5), (1, 0.75), (2, 1.0)]
    assert [m.step for m in client.get_metric_history(found.info.run_id, "train/loss")] == [3]


# --- what the trainer logs after a step, against a store


@pytest.fixture
def store(tmp_path) -> sessionmaker:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    upgrade(url)
    sessions = sessionmaker(make_sync_engine(url))
    with sessions.begin() as s:
        s.add(
            Run(
                id="run_s",
                name="s",
                model="tiny",
                model_path="/x",
                config=CONFIG,
                counters={"late_rewards": 3},
            )
        )
        s.flush()
        # e1, e2 sampled by version 1, e3 by version 2, e4 across the swap from 1 to 2
        for ep, reward, starts in [
            ("e1", 0.0, None),
            ("e2", 1.0, None),
            ("e3", 1.0, None),
            ("e4", 0.0, [[0, 1], [1, 2]]),
        ]:
            s.add(Episode(run_id="run_s", id=ep, group_id="g", status="eval", reward=reward))
            s.flush()
            s.add(
                Completion(
                    id=f"c-{ep}",
                    run_id="run_s",
                    episode_id=ep,
                    messages=[],
                    prompt_token_ids=[1],
                    output_token_ids=[2, 3],
                    output_logprobs=[-0.5, -0.5],
                    content="x",
                    finish_reason="stop",
                    temperature=1.0,
                    policy_version=2 if ep == "e3" else 1,
                    version_starts=starts,
                    created_at=datetime.now(UTC),
                )
            )
    return sessions


def test_after_a_step_the_changed_versions_are_logged_once_across_restarts(store, tmp_path) -> None:
    cfg, run = MetricsSinkConfig(dir=tmp_path / "m"), tracked("run_s")
    evals = tmp_path / "m" / "run_s" / "evals.jsonl"

    assert log_eval_figures(store, make_sinks(cfg), run) == 0
    assert [(x["version"], x["episodes"], x["mean_reward"]) for x in jsonl(evals)] == [
        (1, 2, 0.5),
        (2, 1, 1.0),
    ]  # e4 spans the swap: in no version's figures
    with store() as s:
        counters = s.get(Run, "run_s").counters
    assert counters["late_rewards"] == 3  # the gateway's counters kept
    assert counters[LOGGED] == {"1": [2, 0.5, 0.5], "2": [1, 1.0, None]}

    assert log_eval_figures(store, make_sinks(cfg), run) == 0  # a restarted worker: nothing new
    assert len(jsonl(evals)) == 2

    with store.begin() as s:  # a revised reward changes version 1 only
        s.get(Episode, ("run_s", "e1")).reward = 0.5
    assert log_eval_figures(store, make_sinks(cfg), run) == 0
    assert [(x["version"], x["mean_reward"]) for x in jsonl(evals)][2:] == [(1, 0.75)]


def test_nothing_is_read_or_remembered_for_a_run_no_sink_logs(store) -> None:
    assert log_eval_figures(store, make_sinks(MetricsSinkConfig()), tracked("run_s")) == 0
    with store() as s:
        assert s.get(Run, "run_s").counters == {"late_rewards": 3}
