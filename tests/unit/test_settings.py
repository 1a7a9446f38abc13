"""`Settings` builds each component's config from core types, and importing it loads no layer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from core.config import (
    MetricsSinkConfig,
    NodeSpec,
    OverloadConfig,
    QueueConfig,
    ReplicaConfig,
    ServerCredentials,
)
from core.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_settings_loads_nothing_above_the_core() -> None:
    """A worker or a CLI builds `Settings` without the gateway, a backend or the trainer."""
    code = (
        "import json, sys\n"
        "import core.settings, core.config, core.lifeline\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    layers = ("gateway", "inference", "trainer", "rlgate")
    loaded = [m for m in json.loads(out.stdout) if m.split(".")[0] in layers]
    assert loaded == [], f"importing core.settings loaded {loaded}"


def test_each_component_config_comes_from_the_settings(tmp_path: Path) -> None:
    s = Settings(
        data_dir=tmp_path,
        broker_url="redis://127.0.0.1:6379/3",
        queue_name="q",
        step_timeout_s=60.0,
        replica_health_interval_s=1.5,
        replica_max_attempts=2,
        replica_sticky_slack=1,
        replica_drain_timeout_s=9.0,
        overload_max_inflight=100,
        overload_min_inflight=10,
        overload_lag_target_ms=25.0,
        overload_run_share=0.25,
        metrics_dir=tmp_path / "m",
        metrics_tensorboard=True,
        inference_api_key="key",
        weight_sync_secret="secret",
        nnodes=2,
        node_rank=1,
        rdzv_endpoint="node0:29400",
    )
    assert s.queue() == QueueConfig(
        broker_url="redis://127.0.0.1:6379/3",
        data_dir=tmp_path,
        queue_name="q",
        step_timeout_s=60.0,
    )
    assert s.queue().resolved_backend() == "redis://127.0.0.1:6379/3"
    assert s.replica_config() == ReplicaConfig(
        health_interval_s=1.5, max_attempts=2, sticky_slack=1, drain_timeout_s=9.0
    )
    overload = s.overload()
    assert isinstance(overload, OverloadConfig)
    assert (overload.max_inflight, overload.min_inflight) == (100, 10)
    assert overload.lag_target_s == pytest.approx(0.025)
    assert overload.run_share == 0.25
    sinks = s.metrics_sinks()
    assert isinstance(sinks, MetricsSinkConfig)
    assert (sinks.dir, sinks.tensorboard) == (tmp_path / "m", True)
    assert sinks.mlflow_tracking_uri == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    assert s.node() == NodeSpec(2, 1, "node0:29400")
    assert s.server_credentials() == ServerCredentials("key", "secret")


def test_the_environment_is_read_once_by_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLGATE_QUEUE_NAME", "from-env")
    monkeypatch.setenv("RLGATE_OVERLOAD_MAX_QUEUE", "7")
    s = Settings()
    assert s.queue().queue_name == "from-env"
    assert s.overload().max_queue == 7


def test_an_overload_cross_field_error_names_the_option() -> None:
    with pytest.raises(ValueError, match="overload_min_inflight"):
        Settings(overload_min_inflight=200, overload_max_inflight=100).overload()
    with pytest.raises(ValueError, match="overload_run_share"):
        OverloadConfig(run_share=0.0)
    assert Settings(overload_max_inflight=0).overload().max_inflight == 0  # unbounded: no floor


def test_a_node_spec_checks_its_place_and_rendezvous() -> None:
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        Settings(nnodes=2, node_rank=0).node()
    with pytest.raises(ValueError, match="node_rank"):
        Settings(nnodes=2, node_rank=2, rdzv_endpoint="h:1").node()
    assert NodeSpec().torchrun_args() == ["--standalone"]
    assert NodeSpec(2, 0, "h:1").local_ranks(4) == 2


def test_credentials_never_print_their_secrets() -> None:
    creds = ServerCredentials("sk-very-secret", "wire-secret")
    assert "secret" not in repr(creds).replace("weight_sync_secret", "")
    assert repr(creds) == "ServerCredentials(set=['api_key', 'weight_sync_secret'])"
    assert creds.headers() == {"Authorization": "Bearer sk-very-secret"}
    assert ServerCredentials().headers() == {}


def test_the_queue_outlives_the_step_timeout_at_the_broker(tmp_path: Path) -> None:
    q = QueueConfig(data_dir=tmp_path, step_timeout_s=1800.0)
    assert q.visibility_timeout_s() == 3600.0
    assert QueueConfig(step_timeout_s=60.0).visibility_timeout_s() == 360.0
    assert q.resolved_broker() == "filesystem://"
    assert q.resolved_backend() == f"file://{(tmp_path / 'celery-results').resolve()}"
