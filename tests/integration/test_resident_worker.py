"""Resident ranks under real `rlgate worker` processes (Redis broker, SQLite store, tiny model).

- SIGTERM and SIGKILL of the worker leave no rank behind (/proc), and SIGTERM
  releases the group properly first (AdamW's state saved).
- Two workers on loopback acting as two nodes (`--nnodes 2`, one rank each, gloo,
  torch's c10d rendezvous) train a step to the same weights as one node with two ranks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from safetensors.torch import load_file

from core.lifeline import child_env
from core.settings import Settings
from rlgate.seed_rows import StepShape, seed_store
from rlgate.stack import free_port, settings_env, start_worker, stop
from tests.procs import alive, children_of
from trainer.config import RunConfig
from trainer.tasks import Trainer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SHAPE = StepShape(groups=2, group_size=2)
CFG = RunConfig(
    group_size=2,
    groups_per_step=2,
    micro_batch_size=2,
    learning_rate=1e-4,
    engine="fsdp",
    world_size=2,
)


def _settings(tmp_path: Path, redis_url: str, **extra) -> Settings:
    s = Settings(
        data_dir=tmp_path / "data",
        broker_url=redis_url,
        queue_name=f"resident-{tmp_path.name}",
        trainer_threads=2,
        dev_mode=True,
        **extra,
    )
    s.data_dir.mkdir(parents=True, exist_ok=True)
    return s


def _seed(settings: Settings, model: Path, run_id: str, steps: int = 1) -> None:
    seed_store(settings.resolved_database_url, model, CFG, steps, SHAPE, run_id, seed=2)


def _train(settings: Settings, run_id: str, step: int) -> dict:
    """Send the step through Celery, as the gateway does, and wait for its result."""
    from trainer.celery_app import make_celery
    from trainer.submit import submit_train_step

    celery = make_celery(settings.queue())
    try:
        return celery.AsyncResult(submit_train_step(celery, run_id, step)).get(timeout=600)
    finally:
        celery.close()


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        kids = children_of(todo.pop())
        found += kids
        todo += kids
    return found


def _ranks(pid: int) -> list[int]:
    """The resident rank processes under `pid` (torchrun's children running resident_rank)."""
    out = []
    for p in _descendants(pid):
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            continue
        if b"trainer.resident_rank" in cmd and b"torch.distributed.run" not in cmd:
            out.append(p)
    return out


def _gone(pids: list[int], timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not any(alive(p) for p in pids)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_stopped_worker_leaves_no_rank_behind(
    sig: signal.Signals, redis_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    settings = _settings(tmp_path, redis_url)
    run = f"r-{uuid.uuid4().hex[:8]}"  # Celery task ids are per (run, step): one run per test
    _seed(settings, tiny_model_dir, run)
    worker = start_worker(settings, tmp_path / "worker.log")
    try:
        assert _train(settings, run, 0)["version"] == 1
        ranks = _ranks(worker.pid)
        tree = _descendants(worker.pid)
        assert len(ranks) == 2, f"expected the 2 resident ranks under the worker, got {tree}"
        os.kill(worker.pid, sig)
        worker.wait(120)
        assert _gone(tree), f"left behind: {[p for p in tree if alive(p)]}"
        saved = settings.checkpoints_dir / run / "optimizer-fsdp" / "v1" / "meta.json"
        # SIGTERM is a shutdown: the group is released, AdamW's state saved; SIGKILL is a crash
        assert saved.is_file() is (sig == signal.SIGTERM)
    finally:
        stop(worker)


def _rlgate_worker(settings: Settings, log: Path, *flags: str) -> subprocess.Popen:
    """`rlgate worker FLAGS` with `settings` in its environment, dying with this process."""
    rlgate = Path(sys.executable).with_name("rlgate")
    out = open(log, "ab")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(
        [str(rlgate), "worker", *flags],
        env=child_env(settings_env(settings)),
        stdout=out,
        stderr=subprocess.STDOUT,
    )


def test_two_workers_as_two_nodes_train_like_one_node(
    redis_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    settings = _settings(tmp_path, redis_url)
    tag = uuid.uuid4().hex[:8]  # Celery task ids are per (run, step): fresh runs per test
    one, two = f"one-node-{tag}", f"two-nodes-{tag}"
    _seed(settings, tiny_model_dir, one)
    _seed(settings, tiny_model_dir, two)
    trainer = Trainer(settings)  # one node, two ranks: the reference
    try:
        trainer.train_step(one, 0)
    finally:
        trainer.close()

    endpoint = f"127.0.0.1:{free_port()}"
    nodes = ["--nnodes", "2", "--rdzv-endpoint", endpoint]
    joiner = _rlgate_worker(settings, tmp_path / "node1.log", *nodes, "--node-rank", "1")
    owner = _rlgate_worker(settings, tmp_path / "node0.log", *nodes, "--node-rank", "0")
    try:
        result = _train(settings, two, 0)
        assert result["version"] == 1
        # one rank on each node: the group spans both workers
        assert len(_ranks(owner.pid)) == 1 and len(_ranks(joiner.pid)) == 1
        with trainer.sessions() as s:
            from core.store.models import TrainStep

            metrics = s.get(TrainStep, (two, 0)).metrics
        assert metrics["world_size"] == 2 and metrics["grad_norm"] > 0
        with trainer.sessions() as s:  # the directories the store records for v1
            from core.store.models import PolicyVersion

            got, want = (
                load_file(Path(s.get(PolicyVersion, (r, 1)).checkpoint_path) / "model.safetensors")
                for r in (two, one)
            )
        base = load_file(tiny_model_dir / "model.safetensors")
        assert set(got) == set(want)
        for name, w in want.items():
            assert (got[name] - w).abs().max().item() <= 1e-5, name
        moved = (want["lm_head.weight"] - base["lm_head.weight"]).abs().median().item()
        assert moved > 1e-5, "the step barely moved the weights: the comparison is vacuous"
        tree = _descendants(owner.pid) + _descendants(joiner.pid)
    finally:
        stop(owner)
        stop(joiner)
    assert _gone(tree), f"left behind: {[p for p in tree if alive(p)]}"
