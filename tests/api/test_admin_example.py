"""examples/admin.sh runs against a real gateway (it is the admin API docs' code)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "admin.sh"


def test_admin_example(gateway_server) -> None:
    env = dict(os.environ, RLGATE_URL=gateway_server.url, RLGATE_ADMIN_KEY=gateway_server.admin_key)
    out = subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    run_id = out.stdout.split()[1]
    assert "admin-example-2" in out.stdout  # renamed live
    assert f"{run_id}-v0/config.json" in out.stdout  # the checkpoint tar
    assert f'rlgate_completions_total{{run_id="{run_id}"}} 1.0' in out.stdout  # /metrics
    assert "delete active: 409" in out.stdout
    assert '"deleted":true' in out.stdout
    assert gateway_server.query("SELECT COUNT(*) FROM runs WHERE id = ?", (run_id,))[0][0] == 0
    assert gateway_server.query("SELECT COUNT(*) FROM completions WHERE run_id = ?", (run_id,)) == [
        (0,)
    ]
