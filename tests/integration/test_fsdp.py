"""FSDP2 over torchrun (2 gloo ranks on CPU) against the single-process LocalEngine.

Same checkpoint, samples, config and seed: the loss must agree to float
noise, and the saved weights to 1e-5. The tolerance is about AdamW's first
step: with zero moments it moves each weight by lr * g / (|g| + eps), nearly
lr * sign(g), so for gradients near eps a 1e-8 difference in reduction
order (ranks sum in another order than one process) changes that weight's
update by up to a few percent of lr. lr = 1e-4 keeps that under 1e-5 while
the weights themselves move by ~lr, which the test checks too.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from trainer.batch import Sample
from trainer.config import RunConfig
from trainer.engine import LocalEngine
from trainer.launch import FsdpStepError, run_fsdp_step, write_samples
from trainer.parallel import resolve_backend

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LR = 1e-4
CFG = RunConfig(learning_rate=LR, micro_batch_size=3, group_size=2, groups_per_step=5, seed=0)


def _samples(n: int, vocab: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(6, 40)
        prompt = rng.randint(2, length - 2)
        trained = length - prompt
        out.append(
            Sample(
                input_ids=[rng.randrange(3, vocab) for _ in range(length)],
                loss_mask=[0] * prompt + [1] * trained,
                old_logprobs=[0.0] * prompt + [-rng.uniform(4.5, 7.0) for _ in range(trained)],
                advantages=[0.0] * prompt + [rng.choice([-1.0, 0.5, 1.0])] * trained,
                temperatures=[1.0] * prompt + [rng.choice([1.0, 0.7])] * trained,
                min_version=0,
            )
        )
    return out


@pytest.mark.parametrize(
    "parallel",
    [
        {"packing": True, "pack_tokens": 64},
        {"packing": False, "activation_checkpointing": True, "reshard_after_forward": False},
    ],
    ids=["packed", "padded-checkpointed"],
)
def test_two_rank_fsdp_step_matches_local_engine(
    tiny_model_dir: Path, tmp_path: Path, parallel: dict
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = LocalEngine(tiny_model_dir, 0, CFG)
    before = {k: v.clone() for k, v in local.model.state_dict().items()}
    samples = _samples(10, local.model.config.vocab_size)
    expected = local.step(samples)
    after = local.model.state_dict()

    out = tmp_path / "v1"
    metrics = run_fsdp_step(
        tiny_model_dir,
        0,
        CFG.model_dump(),
        write_samples(samples, tmp_path / "samples.pt"),
        out,
        tiny_model_dir,
        world_size=2,
        parallel=parallel,
        timeout_s=600,
    )
    assert metrics["world_size"] == 2 and metrics["version"] == 1
    assert metrics["tokens"] == expected["tokens"] and metrics["tokens"] > 100
    assert metrics["loss"] == pytest.approx(expected["loss"], abs=1e-6)
    assert metrics["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    assert metrics["clip_frac"] == pytest.approx(expected["clip_frac"], abs=1e-6)

    # an untied HF directory, written atomically, that transformers loads as is
    assert not (tmp_path / "v1.tmp").exists()
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(f.keys())
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(out).chat_template
    head, emb = reloaded.get_output_embeddings().weight, reloaded.get_input_embeddings().weight
    assert head.data_ptr() != emb.data_ptr()

    saved = reloaded.state_dict()
    assert set(saved) == set(after)
    for name, weight in after.items():
        diff = (saved[name] - weight).abs().max().item()
        assert diff <= 1e-5, f"{name}: FSDP and local weights differ by {diff:.2e}"
    moved = (after["lm_head.weight"] - before["lm_head.weight"]).abs().median().item()
    assert moved > 0.5 * LR, "the step barely moved the weights: the comparison is vacuous"


def test_a_tied_source_model_is_saved_with_an_explicit_head(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """In-process, one rank (init_distributed's single-process group)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from trainer.fsdp_engine import FsdpEngine

    config = LlamaConfig.from_pretrained(tiny_model_dir)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    tied = tmp_path / "tied"
    LlamaForCausalLM(config).save_pretrained(tied)
    engine = FsdpEngine(tied, 0, CFG)
    try:
        engine.step(_samples(4, config.vocab_size))
        engine.save(tmp_path / "v1", tiny_model_dir)
    finally:
        engine.close()
    with safe_open(tmp_path / "v1" / "model.safetensors", "pt") as f:
        assert "lm_head.weight" in set(f.keys())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "v1")
    assert reloaded.config.tie_word_embeddings is False
    head, emb = reloaded.get_output_embeddings().weight, reloaded.get_input_embeddings().weight
    assert head.data_ptr() != emb.data_ptr() and torch.equal(head, emb)
    assert (tmp_path / "v1" / "tokenizer.json").is_file()


def test_a_failing_step_raises_with_the_ranks_stderr(tiny_model_dir: Path, tmp_path: Path) -> None:
    corrupt = tmp_path / "samples.pt"
    corrupt.write_bytes(b"not a torch file")
    with pytest.raises(FsdpStepError) as info:
        run_fsdp_step(
            tiny_model_dir,
            0,
            CFG.model_dump(),
            corrupt,
            tmp_path / "v1",
            tiny_model_dir,
            world_size=2,
            timeout_s=300,
        )
    message = str(info.value)
    assert "torchrun exit 1" in message
    # the ranks' own stderr files are attached (a rank killed early may have written nothing)
    assert "/attempt_0/0/stderr.log" in message
    assert "UnpicklingError" in message
    assert not (tmp_path / "v1").exists()


def test_a_missing_checkpoint_fails_before_launching(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        run_fsdp_step(
            tmp_path / "nope", 0, CFG.model_dump(), tmp_path / "s.pt", tmp_path / "v1", tmp_path, 2
        )


def test_nccl_without_cuda_is_a_config_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: nccl is a valid choice here")
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("nccl")
    assert resolve_backend("auto") == "gloo"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices for NCCL")
def test_two_rank_nccl_step_matches_local_engine(tiny_model_dir: Path, tmp_path: Path) -> None:
    local = LocalEngine(tiny_model_dir, 0, CFG)
    samples = _samples(10, local.model.config.vocab_size)
    expected = local.step(samples)
    metrics = run_fsdp_step(
        tiny_model_dir,
        0,
        CFG.model_dump(),
        write_samples(samples, tmp_path / "samples.pt"),
        tmp_path / "v1",
        tiny_model_dir,
        world_size=2,
        parallel={"backend": "nccl"},
        timeout_s=600,
    )
    # TF32 and other GPU kernels: a looser bound than the gloo test
    assert metrics["loss"] == pytest.approx(expected["loss"], abs=1e-4)
