"""LoRA runs in the trainer: only the adapter trains, a version is the adapter, the KL
reference is the base with the adapter off, and AdamW's state resumes across versions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from inference.lora import merge_adapter, read_adapter
from trainer.batch import Sample, collate
from trainer.config import LORA_DEFAULT_TARGETS, RunConfig
from trainer.local_engine import LocalEngine
from trainer.lora import is_adapter_dir
from trainer.packing import trainable_batch


def _samples() -> list[Sample]:
    return [
        Sample(
            [5, 6, 7, 8, 9],
            [0, 0, 1, 1, 1],
            [0, 0, -5.0, -5.0, -5.0],
            [0, 0, a, a, a],
            [1.0] * 5,
            0,
        )
        for a in (1.0, -1.0)
    ]


def _cfg(**kw) -> RunConfig:
    base = dict(group_size=2, groups_per_step=1, micro_batch_size=2, learning_rate=1e-2)
    return RunConfig(**{**base, "lora_rank": 4, **kw})


def test_lora_options_are_checked_at_creation() -> None:
    cfg = _cfg()
    assert cfg.resolved_lora_alpha() == 8.0 and cfg.resolved_lora_targets() == list(
        LORA_DEFAULT_TARGETS
    )
    for bad in (
        {"lora_rank": 0},
        {"lora_rank": None, "lora_alpha": 4},
        {"lora_dropout": 1.0},
        {"lora_target_modules": []},
        {"lora_target_modules": ["q_proj; rm -rf"]},
        {"engine": "megatron"},
    ):
        with pytest.raises(ValidationError):
            _cfg(**bad)
    assert RunConfig().lora_rank is None and not RunConfig().lora


def test_a_step_trains_the_adapter_only_and_saves_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = LocalEngine(tiny_model_dir, 0, _cfg(), reference_dir=tiny_model_dir)
    frozen = {n: p.detach().clone() for n, p in engine.model.named_parameters() if "lora_" not in n}
    trained = list(engine.trained_parameters())
    assert trained and all(
        "lora_" in n for n, p in engine.model.named_parameters() if p.requires_grad
    )
    metrics = engine.step(_samples())
    assert metrics["grad_norm"] > 0 and engine.version == 1
    for n, p in engine.model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n  # the base never moves
    out = tmp_path / "v1"
    engine.save(out, tiny_model_dir)
    assert is_adapter_dir(out) and (out / "tokenizer.json").is_file()
    assert not (out / "model.safetensors").exists()
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    adapter = read_adapter(out, base, 1)  # what the local backend will serve
    assert set(n.rsplit(".", 1)[-1] for n in adapter.layers) == set(LORA_DEFAULT_TARGETS)
    size = sum(f.stat().st_size for f in out.iterdir())
    model_size = (tiny_model_dir / "model.safetensors").stat().st_size
    assert size < model_size, (size, model_size)


def test_the_kl_reference_is_the_base_with_the_adapter_off(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = _cfg(kl_coef=0.1)
    engine = LocalEngine(tiny_model_dir, 0, cfg, reference_dir=tiny_model_dir)
    engine.step(_samples())  # the adapter is no longer zero
    full = LocalEngine(
        tiny_model_dir, 0, RunConfig(group_size=2, groups_per_step=1, micro_batch_size=2)
    )
    batch = trainable_batch(collate(_samples(), engine.pad_id))
    fwd = engine.forward(_samples())
    base = full.token_logprobs(batch)
    assert torch.allclose(fwd.ref_logp, base, atol=1e-6)
    assert not torch.allclose(fwd.logp.detach(), base, atol=1e-4)
    assert sum(p.numel() for p in engine.model.parameters()) < 1.2 * sum(
        p.numel() for p in full.model.parameters()
    )  # no second copy of the model


def test_a_version_resumes_from_its_adapter_and_optimizer_state(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = _cfg()
    first = LocalEngine(tiny_model_dir, 0, cfg, reference_dir=tiny_model_dir)
    first.step(_samples())
    first.save(tmp_path / "v1", tiny_model_dir)
    first.save_optimizer(tmp_path / "state")
    resumed = LocalEngine(tmp_path / "v1", 1, cfg, reference_dir=tiny_model_dir)
    assert resumed.load_optimizer(tmp_path / "state")
    batch = trainable_batch(collate(_samples(), first.pad_id))
    assert torch.allclose(first.token_logprobs(batch), resumed.token_logprobs(batch), atol=1e-6)
    # the next step from the resumed engine is the step the first would have taken
    a, b = first.step(_samples()), resumed.step(_samples())
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    assert torch.allclose(first.token_logprobs(batch), resumed.token_logprobs(batch), atol=1e-5)


def test_the_merged_export_is_a_plain_model_with_the_adapters_logprobs(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    engine = LocalEngine(tiny_model_dir, 0, _cfg(), reference_dir=tiny_model_dir)
    engine.step(_samples())
    engine.save(tmp_path / "v1", tiny_model_dir)
    merge_adapter(tiny_model_dir, tmp_path / "v1", tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    batch = trainable_batch(collate(_samples(), engine.pad_id))
    assert torch.allclose(
        engine.token_logprobs(batch), engine.token_logprobs(batch, merged), atol=1e-5
    )
