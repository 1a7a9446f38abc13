"""`resolve_backend`: NCCL only with a CUDA device for each rank on the host.

No GPU here: `torch.cuda` is patched to report devices (the decision alone is
tested; the NCCL step itself ran on a lent H200, tests/integration/test_fsdp.py).
"""

from __future__ import annotations

import pytest
import torch

from trainer.parallel import resolve_backend


@pytest.fixture
def one_gpu(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_auto_is_nccl_only_with_a_device_per_local_rank(one_gpu) -> None:
    assert resolve_backend("auto", 1) == "nccl"
    assert resolve_backend("auto", 2) == "gloo"  # two ranks, one GPU: NCCL would fail


def test_nccl_with_more_ranks_than_devices_is_a_config_error(one_gpu) -> None:
    with pytest.raises(ValueError, match="2 rank"):
        resolve_backend("nccl", 2)
    assert resolve_backend("gloo", 2) == "gloo"


def test_the_local_rank_count_comes_from_torchrun(one_gpu, monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resolve_backend("auto") == "gloo"
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert resolve_backend("auto") == "nccl"
