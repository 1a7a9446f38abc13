"""The W&B and MLflow sinks on their real local stores: W&B offline files, an MLflow SQLite store.

Each test plays a worker restart: a second `MetricsSinks` (a fresh worker
process has nothing else) must find the first one's tracker run again.
"""

from __future__ import annotations

import os
import socket
import sys
import time

import pytest
from pydantic import ValidationError
from wandb import teardown as wandb_teardown

from tests.wandb_records import offline_runs
from trainer.config import RunConfig, TrackingConfig
from trainer.metrics_sinks import MetricsSinkConfig, TrackedRun, make_sinks, trackers_for

CONFIG = RunConfig(group_size=2, groups_per_step=2, micro_batch_size=2).model_dump()
STEPS = {
    1: {"loss": 0.5, "reward_mean": 0.25, "tokens": 32, "staleness_histogram": {"0": 4}},
    2: {"loss": -0.125, "reward_mean": 0.5, "tokens": 40},
    3: {"loss": 0.0625, "reward_mean": 0.75, "tokens": 28},
}


def tracked(run_id: str, **tracking) -> TrackedRun:
    return TrackedRun(run_id, "unit-run", "tiny", CONFIG, TrackingConfig(**tracking))


@pytest.mark.parametrize(
    ("run", "worker", "expected"),
    [
        ({}, {}, []),
        ({}, {"wandb_project": "team"}, ["wandb"]),
        ({"wandb": False}, {"wandb_project": "team"}, []),
        ({"wandb_project": "mine"}, {}, ["wandb"]),
        ({"mlflow": True}, {}, ["mlflow"]),
        ({"mlflow": False}, {"mlflow_experiment": "team"}, []),
        (
            {"wandb": True, "mlflow_experiment": "mine"},
            {"wandb_project": "team"},
            ["wandb", "mlflow"],
        ),
    ],
)
def test_the_run_choice_wins_over_the_worker(run, worker, expected) -> None:
    assert trackers_for(TrackingConfig(**run), MetricsSinkConfig(**worker)) == expected


@pytest.mark.parametrize(
    ("tracking", "message"),
    [
        ({"wandb": False, "wandb_project": "p"}, "wandb_project is set but wandb is false"),
        ({"mlflow": False, "mlflow_experiment": "e"}, "mlflow_experiment is set but mlflow"),
        ({"wandb_project": "a/b"}, "should match pattern"),
        ({"mlflow_experiment": ""}, "at least 1 character"),
        ({"neptune": True}, "Extra inputs are not permitted"),
    ],
)
def test_contradictory_or_unknown_tracking_options_are_rejected(tracking, message) -> None:
    with pytest.raises(ValidationError, match=message):
        RunConfig.model_validate({"tracking": tracking})


@pytest.mark.slow  # W&B starts its core service
def test_wandb_one_offline_run_per_rlgate_run_resumed_after_a_restart(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    # W&B keeps the settings of its first run in the process (its dir among them)
    wandb_teardown()
    cfg = MetricsSinkConfig(wandb_project="unit")
    for versions in ([1, 2], [3]):  # the second MetricsSinks is a restarted worker
        sinks = make_sinks(cfg)
        for v in versions:
            assert sinks.log(tracked("run_w"), v, STEPS[v]) == 0
        sinks.close()
        time.sleep(1.1)  # W&B names an offline run's directory by the second it opened

    runs = offline_runs(tmp_path, "run_w")
    assert len(runs) == 2  # one directory per worker process, both W&B run "run_w"
    assert {(r.run_id, r.project) for r in runs} == {("run_w", "unit")}
    for r in runs:  # the config, once per open: the run's identity and its RunConfig
        assert r.config["rlgate_run_id"] == "run_w" and r.config["model"] == "tiny"
        assert r.config["group_size"] == 2 and r.config["parallel"]["backend"] == "auto"
    history = [row for r in runs for row in r.history]
    assert [row["_step"] for row in history] == [1, 2, 3]
    for row in history:
        scalars = {k: v for k, v in STEPS[row["_step"]].items() if not isinstance(v, dict)}
        assert {k: row[f"train/{k}"] for k in scalars} == scalars
        assert "train/staleness_histogram" not in row


@pytest.mark.slow  # MLflow builds its SQLite schema
def test_mlflow_one_run_found_again_by_its_tag_after_a_restart(tmp_path) -> None:
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = MetricsSinkConfig(mlflow_tracking_uri=uri)
    for versions in ([1, 2], [3]):
        sinks = make_sinks(cfg)
        for v in versions:
            assert sinks.log(tracked("run_m", mlflow_experiment="unit"), v, STEPS[v]) == 0
        sinks.close()

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("unit")
    (run,) = client.search_runs([experiment.experiment_id])  # one MLflow run, not one per worker
    assert run.data.tags["rlgate.run_id"] == "run_m"
    assert run.info.run_name == "unit-run" and run.info.status == "FINISHED"
    params = run.data.params
    assert params["rlgate_run_id"] == "run_m" and params["group_size"] == "2"
    assert params["parallel.backend"] == "auto" and params["tracking.wandb"] == "null"
    for key in ("loss", "reward_mean", "tokens"):
        history = client.get_metric_history(run.info.run_id, f"train/{key}")
        assert [(m.step, m.value) for m in history] == [(v, STEPS[v][key]) for v in (1, 2, 3)]


def test_a_failing_tracker_is_counted_and_the_other_sinks_still_write(
    tmp_path, monkeypatch, caplog
) -> None:
    with socket.socket() as sock:  # a port nobody listens on: connections are refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setitem(sys.modules, "wandb", None)  # W&B asked for but not installed
    cfg = MetricsSinkConfig(
        dir=tmp_path,
        wandb_project="team",
        mlflow_experiment="team",
        mlflow_tracking_uri=f"http://127.0.0.1:{port}",
    )
    sinks = make_sinks(cfg)
    assert sinks.log(tracked("run_f"), 1, STEPS[1]) == 2  # W&B and MLflow, not JSONL
    assert "pip install 'rlgate[wandb]'" in caplog.text
    assert "metrics sink MlflowSink failed for run run_f" in caplog.text
    assert (tmp_path / "run_f" / "metrics.jsonl").read_text().count("\n") == 1
    assert sinks.log(tracked("run_f", wandb=False, mlflow=False), 2, STEPS[2]) == 0
    sinks.close()


def test_a_tracker_that_cannot_even_start_is_counted(caplog) -> None:
    # MLflow's client opens its store when built: an unknown scheme fails right there
    cfg = MetricsSinkConfig(mlflow_tracking_uri="nosuchstore://host/path")
    sinks = make_sinks(cfg)
    assert sinks.log(tracked("run_s", mlflow=True), 1, STEPS[1]) == 1
    assert "metrics sink mlflow could not start for run run_s" in caplog.text
    assert sinks.log(tracked("run_s", mlflow=True), 2, STEPS[2]) == 1  # tried again, counted again
    sinks.close()


def test_mlflow_retries_are_bounded_unless_the_environment_says_otherwise(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainer.tracker_sinks import MLFLOW_HTTP_DEFAULTS, MlflowSink

    for name in MLFLOW_HTTP_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "45")
    MlflowSink(f"sqlite:///{tmp_path / 'mlflow.db'}", None)
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "2"  # rlgate's bound
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "45"  # the operator's choice
