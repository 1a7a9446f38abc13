"""The CLI contract (design.md): `rlgate up` serves /health; `runs create --json` prints a run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlgate.stack import free_port, stop, wait_healthy

pytestmark = pytest.mark.integration


def test_up_then_runs_create_json(tmp_path, model_cache_dir, tiny_model_dir) -> None:
    port = free_port()
    env = dict(
        os.environ,
        RLGATE_ADMIN_KEY="cli-test-admin",
        RLGATE_DEV_MODE="false",
        RLGATE_MODEL_CACHE_DIR=str(model_cache_dir),
        RLGATE_DATABASE_URL="",
        RLGATE_BROKER_URL="",
    )
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlgate.cli",
            "up",
            "--port",
            str(port),
            "--data-dir",
            str(tmp_path / "data"),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", up, timeout_s=120)
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "rlgate.cli",
                "runs",
                "create",
                "--name",
                "cli",
                "--model",
                "tiny",
                "--json",
            ],
            env=dict(env, RLGATE_URL=f"http://127.0.0.1:{port}"),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        run = json.loads(out.stdout)
        assert {"run_id", "api_key", "base_url", "model"} <= run.keys()
        assert run["base_url"] == f"http://127.0.0.1:{port}/v1" and run["model"] == "tiny"
        # the worker `rlgate up` started is a real Celery worker process
        assert (tmp_path / "data" / "worker.log").exists()
        wrong = subprocess.run(
            [
                sys.executable,
                "-m",
                "rlgate.cli",
                "runs",
                "create",
                "--name",
                "x",
                "--model",
                "tiny",
            ],
            env=dict(env, RLGATE_URL=f"http://127.0.0.1:{port}", RLGATE_ADMIN_KEY="nope"),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert wrong.returncode == 1 and "invalid_admin_key" in wrong.stderr
    finally:
        stop(up)


def test_up_refuses_to_start_without_an_admin_key_outside_dev_mode(tmp_path) -> None:
    env = dict(os.environ, RLGATE_ADMIN_KEY="", RLGATE_DEV_MODE="false")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlgate.cli",
            "up",
            "--port",
            str(free_port()),
            "--data-dir",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "RLGATE_ADMIN_KEY" in out.stderr
