"""`rlgate up` leaves nothing behind: its worker stops on SIGTERM, SIGINT and SIGKILL of it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from rlgate.stack import free_port, stop, wait_healthy
from tests.procs import alive, children_of

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=str)
def test_up_stops_its_worker_however_it_is_stopped(tmp_path, model_cache_dir, sig) -> None:
    port = free_port()
    env = dict(
        os.environ,
        RLGATE_ADMIN_KEY="signals-admin",
        RLGATE_DEV_MODE="false",
        RLGATE_MODEL_CACHE_DIR=str(model_cache_dir),
        RLGATE_DATABASE_URL="",
        RLGATE_BROKER_URL="",
    )
    cmd = [sys.executable, "-m", "rlgate.cli", "up", "--port", str(port)]
    up = subprocess.Popen(
        [*cmd, "--data-dir", str(tmp_path / "data")],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", up, timeout_s=120)
        deadline = time.monotonic() + 60
        while not (workers := children_of(up.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(workers) == 1, "rlgate up starts exactly one worker process"
        worker = workers[0]
        up.send_signal(sig)
        up.wait(30)
        deadline = time.monotonic() + 30
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(worker), f"the worker outlived `rlgate up` stopped by {sig.name}"
        if sig != signal.SIGKILL:  # it stopped its worker itself, then exited on its own
            assert up.returncode in (0, 128 + sig, -sig), up.returncode
    finally:
        stop(up)
        for pid in children_of(up.pid):
            os.kill(pid, signal.SIGKILL)
