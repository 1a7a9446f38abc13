"""Defaults derive from the batch: a small run is accepted without naming every knob."""

from __future__ import annotations

from typing import TYPE_CHECKING

import httpx
import pytest

from trainer.config import RunConfig

if TYPE_CHECKING:
    from tests.conftest import GatewayServer


@pytest.mark.parametrize(("group_size", "groups_per_step", "micro"), [(2, 1, 2), (4, 4, 8)])
def test_micro_batch_defaults_to_the_batch_capped_at_eight(
    group_size: int, groups_per_step: int, micro: int
) -> None:
    cfg = RunConfig(group_size=group_size, groups_per_step=groups_per_step)
    assert cfg.micro_batch_size is None  # stored unset: a later change of the batch re-derives
    assert cfg.micro_batch == micro


def test_an_explicit_micro_batch_larger_than_the_batch_is_still_refused() -> None:
    with pytest.raises(ValueError, match="micro_batch_size exceeds the batch"):
        RunConfig(group_size=2, groups_per_step=1, micro_batch_size=3)


@pytest.mark.integration
def test_a_run_of_one_group_of_two_is_created(gateway_server: GatewayServer) -> None:
    resp = httpx.post(
        gateway_server.url + "/admin/v1/runs",
        json={"name": "small", "model": "tiny", "config": {"group_size": 2, "groups_per_step": 1}},
        headers=gateway_server.admin_headers(),
        timeout=60,
    )
    assert resp.status_code == 201, resp.text
