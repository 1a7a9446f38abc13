"""`weight_sync` and `save_every_steps` at run creation: a 400 naming the option, nothing stored."""

from __future__ import annotations

from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from tests.conftest import GatewayServer

pytestmark = [pytest.mark.integration]


def _post(server: GatewayServer, config: dict, backend: str = "local") -> httpx.Response:
    return httpx.post(
        server.url + "/admin/v1/runs",
        json={"name": "ws", "model": "tiny", "backend": backend, "config": config},
        headers=server.admin_headers(),
        timeout=60,
    )


@pytest.mark.parametrize(
    ("config", "backend", "param"),
    [
        ({"weight_sync": "nfs"}, "vllm", "config.weight_sync"),
        ({"weight_sync": "collective", "save_every_steps": 0}, "vllm", "config.save_every_steps"),
        ({"weight_sync": "collective", "lora_rank": 8}, "vllm", "config.weight_sync"),
        ({"weight_sync": "collective"}, "local", "config.weight_sync"),  # nothing to send to
    ],
)
def test_bad_weight_sync_settings_are_a_400(
    gateway_server: GatewayServer, config: dict, backend: str, param: str
) -> None:
    before = gateway_server.count("runs")
    resp = _post(gateway_server, config, backend)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert gateway_server.count("runs") == before


def test_collective_on_a_remote_backend_is_stored(gateway_server: GatewayServer) -> None:
    resp = _post(gateway_server, {"weight_sync": "collective", "save_every_steps": 5}, "vllm")
    assert resp.status_code == 201, resp.text
    assert resp.json()["config"]["weight_sync"] == "collective"
    assert resp.json()["config"]["save_every_steps"] == 5
