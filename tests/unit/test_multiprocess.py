"""Several gateway processes on one store: in-process backends refused where created and served."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.control.backends import ServedWeights
from gateway.control.multiprocess import RemoteOnlyPool, RemoteOnlyRuns, refuse_in_process
from gateway.errors import InvalidRequest, Unavailable
from gateway.protocol import RunCreate


def test_only_in_process_kinds_are_refused() -> None:
    with pytest.raises(InvalidRequest) as refused:
        refuse_in_process("local", InvalidRequest)
    assert refused.value.code == "in_process_backend" and refused.value.param == "backend"
    assert "--workers 1" in refused.value.message
    refuse_in_process("vllm", InvalidRequest)  # a remote kind is fine
    refuse_in_process("no-such-kind", InvalidRequest)  # left to the usual validation


async def test_a_local_run_is_not_loaded_by_a_remote_only_pool() -> None:
    pool = RemoteOnlyPool()
    with pytest.raises(Unavailable) as refused:
        await pool.get("run_x", ServedWeights(Path("/nonexistent"), "local", 0, None))
    assert refused.value.code == "in_process_backend"
    assert pool.loaded() == {}


async def test_a_local_run_is_not_created() -> None:
    runs = RemoteOnlyRuns(sessions=None, pool=RemoteOnlyPool(), models_dir=Path("/nonexistent"))
    with pytest.raises(InvalidRequest, match="loads the model inside each gateway process"):
        await runs.create(RunCreate(name="r", model="tiny", backend="local"), "http://gw/v1")
