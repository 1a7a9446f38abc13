"""Torch thread budgets: sampling and training together never ask for more threads than cores."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from core.settings import Settings, available_cores, thread_budget
from inference.local import LocalBackend
from trainer.tasks import Trainer


@pytest.mark.parametrize("cores", range(1, 65))
def test_derived_budget_never_oversubscribes(cores: int) -> None:
    b = thread_budget(cores)
    assert b.backend >= 1 and b.trainer >= 1
    assert b.backend + b.trainer <= max(cores, 2)  # one core: 1 + 1, the least either runs on
    assert b.trainer >= b.backend  # the trainer gets the larger half (it decides staleness)


@pytest.mark.parametrize("cores", [2, 3, 4, 8, 16])
def test_one_explicit_value_leaves_the_rest_to_the_other(cores: int) -> None:
    for given in range(1, cores):
        assert thread_budget(cores, backend=given).trainer == cores - given
        assert thread_budget(cores, trainer=given).backend == cores - given


def test_two_cores_split_one_and_one_and_explicit_values_are_kept() -> None:
    assert (thread_budget(2).backend, thread_budget(2).trainer) == (1, 1)
    assert (thread_budget(8).backend, thread_budget(8).trainer) == (4, 4)
    assert thread_budget(2, backend=3, trainer=5).trainer == 5  # the user's choice stands


def test_settings_read_the_budget_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("RLGATE_BACKEND_THREADS", "1")
    monkeypatch.delenv("RLGATE_TRAINER_THREADS", raising=False)
    b = Settings().threads()
    assert b.cores == available_cores()
    assert b.backend == 1 and b.trainer == max(1, b.cores - 1)


def test_torchrun_ranks_split_the_trainer_budget(tmp_path: Path) -> None:
    trainer = Trainer(Settings(data_dir=tmp_path, trainer_threads=4))
    assert [trainer._threads_per_rank(w) for w in (1, 2, 4, 8)] == [4, 2, 1, 1]


@pytest.fixture
def restore_threads() -> Iterator[None]:
    """Setting threads in any thread changes what later threads start with: put it back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


async def test_local_backend_samples_on_its_budget(tiny_model_dir: Path, restore_threads) -> None:
    want = 2 if torch.get_num_threads() == 1 else 1  # unlike torch's default, so it can fail
    be = LocalBackend(tiny_model_dir, threads=want)
    try:
        from inference.types import GenerateRequest, SamplingParams

        await be.generate(GenerateRequest([1, 2, 3], SamplingParams(max_tokens=1)))
        assert be.torch_threads == want  # read inside the thread that runs the model
    finally:
        await be.close()
