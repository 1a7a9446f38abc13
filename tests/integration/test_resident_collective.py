"""`weight_sync: collective` on resident FSDP ranks and on the local engine (real torchrun ranks,
gloo, tiny model): what each offers over the wire is the version it trained, checkpoints are
written every `save_every_steps` versions, and pausing the run writes the one left unsaved.

The receiver here is this test process joining the transfer as rank 1
(`rlgate_weight_wire.receive_weights`), as a vLLM worker does
(tests/integration/test_vllm_collective.py runs vLLM itself).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from core.store.models import Run
from inference.weight_source import offer_path, saved
from inference.weight_wire.rlgate_weight_wire import Rendezvous, receive_weights
from tests.integration.test_resident import (
    BASE,
    _ckpt,
    _gone,
    _row,
    _seed,
    _trainer,
    _wait_released,
)
from trainer.batch import load_step_samples
from trainer.config import RunConfig
from trainer.local_engine import LocalEngine
from trainer.weight_server import hf_state

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SYNC = dict(weight_sync="collective", save_every_steps=2)
LOCAL = RunConfig(**BASE, **SYNC)


def _receive(ckpt: Path, version: int) -> dict[str, torch.Tensor]:
    """Join a transfer of `version` from the trainer that offered it, as one receiver."""
    offer = json.loads(offer_path(ckpt).read_text())
    assert offer["version"] == version
    resp = httpx.post(offer["url"] + "/transfers", json={"version": version, "receivers": 1})
    assert resp.status_code == 200, resp.text
    rdv = Rendezvous.from_json(resp.json())
    return {k: v.clone() for k, v in receive_weights(rdv, 1, 120)}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float) -> None:
    common = set(a) & set(b)
    assert "model.embed_tokens.weight" in common and len(common) >= len(a) - 1
    for name in common:
        assert (a[name] - b[name]).abs().max().item() <= tol, name


@pytest.mark.parametrize("world_size", [2, 1])  # 1: one float32 rank runs unsharded
def test_resident_ranks_offer_every_version_and_save_every_second(
    tiny_model_dir: Path, tmp_path: Path, world_size: int
) -> None:
    fsdp = RunConfig(**BASE, engine="fsdp", world_size=world_size, **SYNC)
    trainer = _trainer(tmp_path)
    _seed(trainer, tiny_model_dir, fsdp, "fsdp", 3)
    _seed(trainer, tiny_model_dir, LOCAL, "local", 3)
    try:
        received: dict[tuple[str, int], dict] = {}
        for step in range(3):
            for run_id in ("fsdp", "local"):
                trainer.train_step(run_id, step)
                v = step + 1
                ckpt = _ckpt(trainer, run_id, v)
                assert saved(ckpt) == (v % 2 == 0), (run_id, v)
                assert _row(trainer, run_id, step).metrics["saved"] == float(v % 2 == 0)
                received[run_id, v] = _receive(ckpt, v)
                if saved(ckpt):  # what was sent is what was saved
                    _close(received[run_id, v], load_file(ckpt / "model.safetensors"), 0.0)
            # the resident group and the local engine trained the same step
            _close(received["fsdp", step + 1], received["local", step + 1], 2e-5)
        assert not offer_path(_ckpt(trainer, "fsdp", 2)).exists()  # only the newest is offered
        base = load_file(tiny_model_dir / "model.safetensors")
        moved = received["fsdp", 3]["model.embed_tokens.weight"] - base["model.embed_tokens.weight"]
        assert moved.abs().max().item() > 1e-4, "the steps barely moved the weights"

        # Pausing releases the group, which first writes v3 (only offered until now).
        pids = trainer.resident.pool.slots["fsdp"].group.pids
        for run_id in ("fsdp", "local"):
            with trainer.sessions.begin() as s:
                s.get(Run, run_id).status = "paused"
        _wait_released(trainer, "fsdp")
        assert _gone(pids)
        v3 = _ckpt(trainer, "fsdp", 3)
        _close(received["fsdp", 3], load_file(v3 / "model.safetensors"), 0.0)
        local_v3 = _ckpt(trainer, "local", 3)
        for _ in range(100):  # the local engine's watcher checks every 2 s
            if saved(local_v3):
                break
            time.sleep(0.1)
        _close(received["local", 3], load_file(local_v3 / "model.safetensors"), 0.0)
    finally:
        trainer.close()


def test_a_crash_loses_only_the_unsaved_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The worker dies holding v1 unsaved: the next step starts from v0's weights (the newest
    saved) and is still recorded as v1 -> v2; what it offers is exactly v0 plus that step."""
    trainer = _trainer(tmp_path)
    _seed(trainer, tiny_model_dir, LOCAL, "r", 2)
    try:
        trainer.train_step("r", 0)
        v1 = _ckpt(trainer, "r", 1)
        assert not saved(v1)
    finally:
        trainer.close()  # a clean stop writes v1 ...
    shutil.rmtree(v1)  # ... so take it away again: what a SIGKILL leaves

    trainer = _trainer(tmp_path)
    try:
        trainer.train_step("r", 1)
        assert _row(trainer, "r", 1).status == "done"
        got = _receive(_ckpt(trainer, "r", 2), 2)
        with trainer.sessions() as s:
            samples, *_ = load_step_samples(s, "r", 1, LOCAL)
        ref = LocalEngine(tiny_model_dir, 1, LOCAL)  # v0's weights, counted as v1
        ref.step(samples)
        _close(got, hf_state(ref.model), 0.0)
    finally:
        trainer.close()
