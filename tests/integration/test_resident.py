"""Resident FSDP ranks through the worker's own `Trainer` (real torchrun ranks, gloo, tiny model).

The store is a SQLite file seeded with queued steps (`rlgate.seed_rows.seed_store`,
the bench's), and `Trainer.train_step` is what the Celery task calls. Each test looks at
the rank processes themselves (/proc), not only at what the trainer says about them.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sqlalchemy.orm import Session

from core.settings import Settings
from core.store.models import PolicyVersion, Run, TrainStep
from core.store.status import StepStatus
from rlgate.seed_rows import StepShape, seed_store
from tests.procs import alive
from trainer.config import RunConfig
from trainer.tasks import Trainer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SHAPE = StepShape(groups=2, group_size=2)
BASE = dict(group_size=2, groups_per_step=2, micro_batch_size=2, learning_rate=1e-4)
FSDP2 = RunConfig(**BASE, engine="fsdp", world_size=2)
LOCAL = RunConfig(**BASE)


def _trainer(tmp_path: Path, **settings) -> Trainer:
    s = Settings(data_dir=tmp_path / "data", trainer_threads=2, dev_mode=True, **settings)
    s.data_dir.mkdir(parents=True, exist_ok=True)
    return Trainer(s)


def _seed(trainer: Trainer, model: Path, cfg: RunConfig, run_id: str, steps: int) -> None:
    # seed 2: a group of the tiny model's steps has mixed rewards, so the weights move
    seed_store(trainer.settings.resolved_database_url, model, cfg, steps, SHAPE, run_id, seed=2)


def _row(trainer: Trainer, run_id: str, step: int) -> TrainStep:
    with trainer.sessions() as s:
        return s.get(TrainStep, (run_id, step))


def _version(trainer: Trainer, run_id: str) -> int:
    with trainer.sessions() as s:
        return s.get(Run, run_id).current_version


def _ckpt(trainer: Trainer, run_id: str, version: int) -> Path:
    """The checkpoint directory the store records for `version` (written or to be)."""
    with trainer.sessions() as s:
        return Path(s.get(PolicyVersion, (run_id, version)).checkpoint_path)


def _weights(trainer: Trainer, run_id: str, version: int) -> dict[str, torch.Tensor]:
    return load_file(_ckpt(trainer, run_id, version) / "model.safetensors")


def _gone(pids: list[int], timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not any(alive(p) for p in pids)


def _requeue(trainer: Trainer, run_id: str, step: int) -> None:
    """What the gateway's scheduler does with a failed step: queue it again, same episodes."""
    from core.store.models import Episode
    from core.store.status import EpisodeStatus

    with trainer.sessions.begin() as s:
        row = s.get(TrainStep, (run_id, step))
        row.status, row.error = StepStatus.QUEUED, None
        for ep in s.query(Episode).filter(Episode.id.like(f"{run_id}-s{step}-%")):
            ep.status, ep.train_step = EpisodeStatus.QUEUED, step


def test_one_group_serves_three_steps_and_matches_the_local_engine(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    trainer = _trainer(tmp_path)
    _seed(trainer, tiny_model_dir, FSDP2, "fsdp", 3)
    _seed(trainer, tiny_model_dir, LOCAL, "local", 3)
    try:
        pids, group_steps = [], []
        for step in range(3):
            trainer.train_step("fsdp", step)
            trainer.train_step("local", step)
            pids.append(trainer.resident.pool.slots["fsdp"].group.pids)
            metrics = _row(trainer, "fsdp", step).metrics
            group_steps.append(metrics["group_steps"])
            assert metrics["optimizer_resumed"] == float(step > 0)  # moments carried in memory
            assert metrics["grad_norm"] > 0  # some group has mixed rewards: a real update
        # the same two rank processes, the model built once: a counter of the group's steps
        assert pids[0] == pids[1] == pids[2] and len(pids[0]) == 2
        assert all(alive(p) for p in pids[0])
        assert group_steps == [1, 2, 3]

        # a duplicate delivery of a done step returns at once and touches nothing
        assert trainer.train_step("fsdp", 1)["skipped"] is True
        assert trainer.resident.pool.slots["fsdp"].group.pids == pids[0]
        assert _version(trainer, "fsdp") == 3

        # three steps with AdamW's moments carried: the local engine's weights, to float noise
        got, want = _weights(trainer, "fsdp", 3), _weights(trainer, "local", 3)
        base = load_file(tiny_model_dir / "model.safetensors")
        assert set(got) == set(want)
        for name, w in want.items():
            assert (got[name] - w).abs().max().item() <= 2e-5, name
        moved = (want["lm_head.weight"] - base["lm_head.weight"]).abs().median().item()
        assert moved > 1e-4, "the steps barely moved the weights: the comparison is vacuous"
    finally:
        trainer.close()
    assert _gone(pids[0]), "released ranks must exit"


def test_a_killed_rank_fails_the_attempt_and_the_retry_reforms_the_group(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    trainer = _trainer(tmp_path)
    _seed(trainer, tiny_model_dir, FSDP2, "r", 2)
    try:
        trainer.train_step("r", 0)
        first = trainer.resident.pool.slots["r"].group.pids
        # Freeze rank 1 so that step 1 is certainly in flight when it dies: the leader has
        # the command and waits on rank 1 in the broadcast.
        os.kill(first[1], signal.SIGSTOP)
        errors: list[BaseException] = []

        def attempt() -> None:
            try:
                trainer.train_step("r", 1)
            except BaseException as exc:  # the test inspects it
                errors.append(exc)

        thread = threading.Thread(target=attempt)
        thread.start()
        deadline = time.monotonic() + 60
        while _row(trainer, "r", 1).status != StepStatus.RUNNING:
            assert time.monotonic() < deadline, "step 1 never started"
            time.sleep(0.1)
        time.sleep(1.0)  # the leader reads the command and blocks on rank 1
        os.kill(first[1], signal.SIGKILL)
        thread.join(300)
        assert not thread.is_alive()
        assert len(errors) == 1 and "resident group" in str(errors[0])
        row = _row(trainer, "r", 1)
        assert row.status == StepStatus.FAILED and _version(trainer, "r") == 1
        assert "r" not in trainer.resident.pool.slots
        assert _gone(first), "the failed group's ranks must all be gone"

        _requeue(trainer, "r", 1)
        assert trainer.train_step("r", 1)["version"] == 2
        second = trainer.resident.pool.slots["r"].group.pids
        assert set(second).isdisjoint(first)
        metrics = _row(trainer, "r", 1).metrics
        assert metrics["group_steps"] == 1  # a new group, formed from v1's checkpoint
        with trainer.sessions() as s:
            assert _versions(s, "r") == [0, 1, 2]  # the version moved once per step
    finally:
        trainer.close()


def _versions(s: Session, run_id: str) -> list[int]:
    return sorted(v.version for v in s.query(PolicyVersion).filter_by(run_id=run_id))


def _wait_released(trainer: Trainer, run_id: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while run_id in trainer.resident.pool.slots:
        assert time.monotonic() < deadline, "the reaper never released the group"
        time.sleep(0.2)


def test_pause_and_idle_release_the_ranks_and_a_new_group_resumes_adamw(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    trainer = _trainer(tmp_path)  # idle after 600 s: only the pause releases the first group
    _seed(trainer, tiny_model_dir, FSDP2, "r", 3)
    ckpts = trainer.settings.checkpoints_dir / "r"
    try:
        trainer.train_step("r", 0)
        pids = trainer.resident.pool.slots["r"].group.pids
        with trainer.sessions.begin() as s:
            s.get(Run, "r").status = "paused"
        _wait_released(trainer, "r")  # the reaper thread reads the run's status every 2 s
        assert _gone(pids)
        # released at v1: AdamW's state saved for v1, although the run does not ask for it
        # after every step (save_optimizer_state is off)
        assert (ckpts / "optimizer-fsdp" / "v1" / "meta.json").is_file()

        with trainer.sessions.begin() as s:
            s.get(Run, "r").status = "active"
        trainer.resident.pool.idle_s = 1.0  # as RLGATE_RESIDENT_IDLE_S=1 would set it
        trainer.train_step("r", 1)
        assert _row(trainer, "r", 1).metrics["optimizer_resumed"] == 1
        pids = trainer.resident.pool.slots["r"].group.pids
        _wait_released(trainer, "r")  # idle past resident_idle_s, the run still active
        assert _gone(pids)
        assert (ckpts / "optimizer-fsdp" / "v2" / "meta.json").is_file()
    finally:
        trainer.close()


def test_a_lora_run_on_resident_ranks_writes_the_local_engines_adapters(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Two steps of a LoRA run (KL to the adapter-off base) on one resident group."""
    from trainer.lora import is_adapter_dir

    lora = dict(lora_rank=4, kl_coef=0.05, learning_rate=1e-2)
    trainer = _trainer(tmp_path)
    _seed(trainer, tiny_model_dir, FSDP2.model_copy(update=lora), "fsdp-lora", 2)
    _seed(trainer, tiny_model_dir, LOCAL.model_copy(update=lora), "local-lora", 2)
    try:
        for step in range(2):
            trainer.train_step("fsdp-lora", step)
            trainer.train_step("local-lora", step)
            fsdp, local = _row(trainer, "fsdp-lora", step), _row(trainer, "local-lora", step)
            assert fsdp.metrics["group_steps"] == step + 1
            assert fsdp.metrics["kl_ref"] == pytest.approx(local.metrics["kl_ref"], abs=1e-5)
            out = _ckpt(trainer, "fsdp-lora", step + 1)
            assert is_adapter_dir(out) and not (out / "model.safetensors").exists()
            mine = load_file(out / "adapter_model.safetensors")
            theirs = load_file(_ckpt(trainer, "local-lora", step + 1) / "adapter_model.safetensors")
            assert mine.keys() == theirs.keys() and mine
            for key, value in mine.items():
                assert torch.allclose(value, theirs[key], atol=1e-5), key
        assert fsdp.metrics["kl_ref"] > 0  # the second step is away from the base
    finally:
        trainer.close()


def test_with_resident_ranks_off_each_step_is_a_group_released_after_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`resident_ranks=false`: every step forms a group from the committed checkpoint and
    releases it; the run keeps AdamW's moments only through `save_optimizer_state`."""
    trainer = _trainer(tmp_path, resident_ranks=False)
    kept = FSDP2.model_copy(update={"save_optimizer_state": True})
    _seed(trainer, tiny_model_dir, kept, "r", 2)
    try:
        for step in range(2):
            trainer.train_step("r", step)
            assert "r" not in trainer.resident.pool.slots  # released after the step
            metrics = _row(trainer, "r", step).metrics
            assert metrics["group_steps"] == 1 and metrics["saved"] == 1.0
            assert metrics["optimizer_resumed"] == float(step > 0)  # read from disk
        assert _version(trainer, "r") == 2
        assert (_ckpt(trainer, "r", 2) / "model.safetensors").is_file()
    finally:
        trainer.close()
