"""The engine registry (one spelling of `RunConfig.engine`) and the `Engine` optimizer-state API.

That every engine reports the same metrics is checked against a real FSDP
engine in tests/integration/test_fsdp.py.
"""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from trainer.batch import Sample
from trainer.config import RunConfig
from trainer.engine import Engine
from trainer.engines import ENGINES, engine_class, engine_entry, torchrun_engine


def _samples(n: int) -> list[Sample]:
    return [
        Sample([5, 6, 7, 8], [0, 0, 1, 1], [0, 0, -5.0, -5.0], [0, 0, a, a], [1.0] * 4, 0)
        for a in (1.0, -1.0) * (n // 2)
    ]


def test_the_registry_spells_every_engine_the_config_accepts() -> None:
    names = typing.get_args(RunConfig.model_fields["engine"].annotation)
    assert set(ENGINES) == set(names)
    assert [n for n in names if engine_entry(n).torchrun] == ["fsdp", "megatron"]
    assert {torchrun_engine(n) for n in names} == {"fsdp", "megatron"}
    with pytest.raises(ValueError, match="engine='megatorn'"):
        engine_entry("megatorn")


def test_every_engine_class_is_an_engine_and_megatron_imports_on_cpu() -> None:
    for name in ENGINES:  # megatron-core is imported inside the engine, never at import
        assert issubclass(engine_class(name), Engine), name


def test_optimizer_state_is_a_directory_holding_optimizer_pt(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Every engine takes a directory; the local one keeps the old `<run>/optimizer.pt` file."""
    from trainer.local_engine import LocalEngine

    cfg = RunConfig(group_size=2, groups_per_step=1, micro_batch_size=2, learning_rate=1e-3)
    engine = LocalEngine(tiny_model_dir, 0, cfg)
    engine.step(_samples(2))
    assert not engine.load_optimizer(None) and not engine.load_optimizer(tmp_path / "missing")
    engine.save_optimizer(tmp_path / "run")
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["optimizer.pt"]
    resumed = LocalEngine(tiny_model_dir, 1, cfg)
    assert resumed.load_optimizer(tmp_path / "run") and resumed.optimizer_resumed
