"""engine='megatron': selection, the clear errors where it cannot run, and its GPU step.

megatron-core is an optional, GPU-only extra that CI does not install: here
the tests check that the configuration routes to `MegatronEngine` and that
a machine without CUDA or megatron-core gets an error naming the option, at
step start (the worker) as well as in a resident rank itself. The real
step runs only in the `gpu` test at the end (skipped on this CPU machine).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from sqlalchemy.orm import Session

from trainer.batch import Sample
from trainer.config import RunConfig
from trainer.engine_check import EngineUnavailable, engine_unavailable

MEGATRON_HERE = engine_unavailable("megatron") is None
SAMPLES = [
    Sample([5, 6, 7, 8], [0, 0, 1, 1], [0, 0, -5.0, -5.0], [0, 0, a, a], [1.0] * 4, 0)
    for a in (1.0, -1.0)
]


def test_megatron_is_a_valid_engine_choice_with_its_own_rules() -> None:
    cfg = RunConfig(engine="megatron", world_size=4, kl_coef=0.1, entropy_coef=0.01)
    assert cfg.engine == "megatron" and cfg.world_size == 4
    with pytest.raises(ValidationError, match="engine='megatron' runs on NCCL"):
        RunConfig(engine="megatron", parallel={"backend": "gloo"})
    with pytest.raises(ValidationError, match="engine"):
        RunConfig(engine="megatorn")


def test_the_other_engines_are_available_everywhere() -> None:
    assert engine_unavailable("local") is None
    assert engine_unavailable("fsdp") is None


@pytest.mark.skipif(MEGATRON_HERE, reason="megatron-core and CUDA are both present")
def test_the_message_names_the_option_and_the_fix() -> None:
    reason = engine_unavailable("megatron")
    assert "engine='megatron'" in reason
    assert "rlgate[megatron]" in reason or "CUDA" in reason


@pytest.mark.skipif(MEGATRON_HERE, reason="megatron-core and CUDA are both present")
def test_a_resident_rank_builds_the_megatron_engine(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A resident rank builds MegatronEngine by config; here it fails before any
    process group is formed, with the clear error instead of an ImportError."""
    from trainer.megatron_engine import MegatronUnavailable
    from trainer.resident_protocol import Init
    from trainer.resident_rank import build_engine

    init = Init(
        config={"run": RunConfig(engine="megatron").model_dump(mode="json")},
        checkpoint_dir=str(tiny_model_dir),
        version=0,
    )
    with pytest.raises(MegatronUnavailable, match="engine='megatron'"):
        build_engine(init)
    assert not (tmp_path / "v1").exists()


@pytest.mark.skipif(MEGATRON_HERE, reason="megatron-core and CUDA are both present")
def test_a_step_of_a_megatron_run_fails_with_the_message(tmp_path: Path) -> None:
    """The worker checks at step start (the gateway cannot when workers run elsewhere):
    the step is marked failed with the reason, and the run's version does not move."""
    from core.settings import Settings
    from core.store.db import make_sync_engine
    from core.store.migrate import upgrade
    from core.store.models import Run, TrainStep
    from trainer.tasks import Trainer

    settings = Settings(data_dir=tmp_path, database_url=f"sqlite:///{tmp_path / 'rlgate.db'}")
    upgrade(settings.resolved_database_url)
    with Session(make_sync_engine(settings.resolved_database_url)) as s, s.begin():
        s.add(
            Run(
                id="run_m",
                name="m",
                model="tiny",
                model_path=str(tmp_path),
                config=RunConfig(engine="megatron").model_dump(mode="json"),
                current_version=0,
                counters={},
            )
        )
        s.flush()
        s.add(TrainStep(run_id="run_m", step=0, status="queued", metrics={"attempts": 1}))
    with pytest.raises(EngineUnavailable, match="engine='megatron'"):
        Trainer(settings).train_step("run_m", 0)
    with Session(make_sync_engine(settings.resolved_database_url)) as s:
        row = s.get(TrainStep, ("run_m", 0))
        assert row.status == "failed" and "engine='megatron'" in row.error
        assert s.get(Run, "run_m").current_version == 0


@pytest.mark.gpu
@pytest.mark.skipif(not MEGATRON_HERE, reason="needs CUDA and megatron-core ([megatron] extra)")
def test_megatron_step_matches_local_engine(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A real 1-rank Megatron-core step (resident torchrun rank, NCCL) against the local engine."""
    from safetensors.torch import load_file

    from tests.integration._one_step import one_step
    from trainer.local_engine import LocalEngine

    cfg = RunConfig(
        engine="megatron", learning_rate=1e-4, group_size=2, groups_per_step=1, micro_batch_size=2
    )
    local = LocalEngine(tiny_model_dir, 0, cfg.model_copy(update={"engine": "local"}))
    expected = local.step(SAMPLES)
    metrics = one_step(
        tiny_model_dir,
        0,
        cfg,
        SAMPLES,
        tmp_path / "v1",
        tiny_model_dir,
        world_size=1,
        timeout_s=600,
    )
    assert metrics["loss"] == pytest.approx(expected["loss"], abs=1e-3)  # TF32 / fused kernels
    saved = load_file(tmp_path / "v1" / "model.safetensors")
    for name, weight in local.model.state_dict().items():
        assert torch.allclose(saved[name], weight, atol=1e-3), name
