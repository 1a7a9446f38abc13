"""A LoRA run on the FSDP engine (2 torchrun ranks, gloo): the adapter it writes is the local
engine's, step for step, with the KL reference and AdamW's state carried between steps."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.integration._one_step import one_step
from trainer.batch import Sample
from trainer.config import RunConfig
from trainer.local_engine import LocalEngine
from trainer.lora import is_adapter_dir

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CONFIG = dict(
    group_size=2,
    groups_per_step=2,
    micro_batch_size=2,
    learning_rate=1e-2,
    lora_rank=4,
    kl_coef=0.05,
    save_optimizer_state=True,
)


def _samples(vocab: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(4):
        n = rng.randint(6, 12)
        ids = [rng.randrange(3, vocab) for _ in range(n)]
        mask = [0] * 3 + [1] * (n - 3)
        adv = (1.0 if i % 2 else -1.0) * (1 + i / 4)
        out.append(Sample(ids, mask, [-3.0] * n, [adv * m for m in mask], [1.0] * n, 0))
    return out


def test_two_fsdp_lora_steps_write_the_local_engines_adapters(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = RunConfig(**CONFIG)
    vocab = 300
    local = LocalEngine(tiny_model_dir, 0, cfg, reference_dir=tiny_model_dir)
    checkpoint = tiny_model_dir  # version 0 of a LoRA run is the base model
    for version in (0, 1):
        batch = _samples(vocab, seed=version)
        expected = local.step(batch)
        local.save(tmp_path / f"local-v{version + 1}", tiny_model_dir)
        out = tmp_path / f"fsdp-v{version + 1}"
        metrics = one_step(
            checkpoint,
            version,
            {**cfg.model_dump(mode="json"), "engine": "fsdp", "world_size": 2},
            batch,
            out,
            tiny_model_dir,
            2,
            parallel={"backend": "gloo", "packing": False},
            reference_dir=tiny_model_dir,
            optimizer_in=tmp_path / "opt" / f"v{version}",
            optimizer_out=tmp_path / "opt" / f"v{version + 1}",
        )
        assert is_adapter_dir(out) and not (out / "model.safetensors").exists()
        assert metrics["optimizer_resumed"] == float(version == 1)
        assert metrics["loss"] == pytest.approx(expected["loss"], abs=1e-5)
        assert metrics["kl_ref"] == pytest.approx(expected["kl_ref"], abs=1e-5)
        mine = load_file(out / "adapter_model.safetensors")
        theirs = load_file(tmp_path / f"local-v{version + 1}" / "adapter_model.safetensors")
        assert mine.keys() == theirs.keys() and mine
        for key, value in mine.items():
            assert torch.allclose(value, theirs[key], atol=1e-5), key
        checkpoint = out
