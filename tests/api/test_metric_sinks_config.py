"""`config.tracking` at run creation: a bad choice is a 400 naming it, a good one is stored."""

from __future__ import annotations

from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from tests.conftest import GatewayServer

pytestmark = pytest.mark.integration


def _post(server: GatewayServer, tracking: dict) -> httpx.Response:
    return httpx.post(
        server.url + "/admin/v1/runs",
        json={"name": "tracked", "model": "tiny", "config": {"tracking": tracking}},
        headers=server.admin_headers(),
        timeout=60,
    )


@pytest.mark.parametrize(
    ("tracking", "param", "message"),
    [
        ({"wandb": False, "wandb_project": "p"}, "config.tracking", "wandb_project is set"),
        ({"mlflow": False, "mlflow_experiment": "e"}, "config.tracking", "mlflow_experiment"),
        ({"wandb_project": "team/project"}, "config.tracking.wandb_project", "pattern"),
        ({"mlflow_experiment": ""}, "config.tracking.mlflow_experiment", "at least 1"),
        ({"wandb": "sometimes"}, "config.tracking.wandb", "boolean"),
        ({"neptune": True}, "config.tracking.neptune", "Extra inputs"),
    ],
)
def test_a_bad_tracking_choice_is_a_400_naming_it(
    gateway_server: GatewayServer, tracking, param, message
) -> None:
    before = gateway_server.count("runs")
    resp = _post(gateway_server, tracking)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert message in error["message"]
    assert gateway_server.count("runs") == before  # nothing stored


def test_the_run_echoes_and_stores_its_tracking_choice(gateway_server: GatewayServer) -> None:
    resp = _post(gateway_server, {"wandb_project": "agents", "mlflow": False})
    assert resp.status_code == 201, resp.text
    assert resp.json()["config"]["tracking"] == {
        "wandb": None,
        "wandb_project": "agents",
        "mlflow": False,
        "mlflow_experiment": None,
    }
    defaults = gateway_server.create_run(name="untracked")["config"]["tracking"]
    assert set(defaults.values()) == {None}  # each tracker as the worker is set
