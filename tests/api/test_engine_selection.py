"""engine='megatron' at run creation: a 400 naming the option when the gateway can tell.

The gateway can tell when the trainer shares its machine (the embedded
broker): megatron-core is missing or there is no CUDA, so the run is
refused before anything is stored. Behind a Redis broker the workers run
elsewhere, so the run is accepted and a worker that cannot run the engine
fails the step with the same message (tests/unit/test_megatron_engine.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from rlgate.stack import stop
from trainer.engine_check import engine_unavailable

if TYPE_CHECKING:
    from tests.conftest import GatewayServer

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        engine_unavailable("megatron") is None, reason="this machine can run engine='megatron'"
    ),
]
MEGATRON = {"engine": "megatron", "world_size": 2}


def _post(server: GatewayServer, config: dict) -> httpx.Response:
    return httpx.post(
        server.url + "/admin/v1/runs",
        json={"name": "megatron", "model": "tiny", "config": config},
        headers=server.admin_headers(),
        timeout=60,
    )


def test_embedded_gateway_refuses_megatron_with_a_400(gateway_server: GatewayServer) -> None:
    before = gateway_server.count("runs")
    resp = _post(gateway_server, MEGATRON)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "config.engine"
    assert "engine='megatron'" in error["message"]
    assert error["type"] == "invalid_request_error"
    assert gateway_server.count("runs") == before  # nothing stored
    assert _post(gateway_server, {"engine": "fsdp", "world_size": 2}).status_code == 201


def test_a_gateway_with_remote_workers_accepts_it(gateway_launcher, tmp_path: Path) -> None:
    server = gateway_launcher(tmp_path / "data", broker_url="redis://127.0.0.1:6379/15")
    try:
        resp = _post(server, MEGATRON)
        assert resp.status_code == 201, resp.text
        assert server.query("SELECT config FROM runs")[0][0].count('"megatron"') == 1
    finally:
        stop(server.proc)
