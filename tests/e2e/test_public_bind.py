"""The published development admin key is never served off loopback (issue #22, item 3).

`rlgate up --host 0.0.0.0` with no RLGATE_ADMIN_KEY used to serve the whole admin API
under `rlgate-dev-admin-key`; it now refuses to start, before the worker, and says why.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from core.settings import DEV_ADMIN_KEY, Settings, is_loopback
from rlgate.stack import free_port


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_loopback_binds(host: str) -> None:
    assert is_loopback(host)
    assert Settings(admin_key="", dev_mode=True).resolved_admin_key(host) == DEV_ADMIN_KEY


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "192.168.0.7", "gateway.lan"])
def test_public_binds_refuse_the_development_key(host: str) -> None:
    assert not is_loopback(host)
    with pytest.raises(ValueError, match="not a loopback address"):
        Settings(admin_key="", dev_mode=True).resolved_admin_key(host)
    # a real key is fine anywhere
    assert Settings(admin_key="s3cret", dev_mode=True).resolved_admin_key(host) == "s3cret"


@pytest.mark.integration
def test_up_on_a_public_bind_without_a_key_exits_with_the_reason(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RLGATE_ADMIN_KEY"}
    env["RLGATE_DEV_MODE"] = "true"
    data = tmp_path / "data"
    argv = ["up", "--host", "0.0.0.0", "--port", str(free_port()), "--data-dir", str(data)]
    out = subprocess.run(
        [sys.executable, "-m", "rlgate.cli", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "not a loopback address" in out.stderr
    assert "RLGATE_ADMIN_KEY" in out.stderr
    assert not (data / "worker.log").exists()  # refused before the worker started


@pytest.mark.integration
def test_serve_on_a_public_bind_without_a_key_exits_with_the_reason() -> None:
    env = {k: v for k, v in os.environ.items() if k != "RLGATE_ADMIN_KEY"}
    out = subprocess.run(
        [sys.executable, "-m", "rlgate.serve", "--host", "0.0.0.0", "--port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "not a loopback address" in out.stderr
