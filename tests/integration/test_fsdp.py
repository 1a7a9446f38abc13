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

from tests.integration._one_step import one_step
from trainer.batch import Sample
from trainer.config import RunConfig
from trainer.local_engine import LocalEngine
from trainer.parallel import resolve_backend
from trainer.resident import ResidentGroupError

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
    metrics = one_step(
        tiny_model_dir,
        0,
        CFG.model_dump(),
        samples,
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


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float) -> None:
    assert set(got) == set(want)
    for name, weight in want.items():
        diff = (got[name] - weight).abs().max().item()
        assert diff <= tol, f"{name}: FSDP and local weights differ by {diff:.2e}"


def test_fsdp_optimizer_state_resumes_across_steps(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two torchrun steps (two process groups, as after a worker restart) with the AdamW
    state saved and loaded between them match two steps of one LocalEngine; with the state
    deleted, the second step falls back to fresh AdamW, logs it, and matches that instead."""
    cfg = CFG.model_copy(update={"save_optimizer_state": True})
    local = LocalEngine(tiny_model_dir, 0, cfg)
    vocab = local.model.config.vocab_size
    first, second = _samples(10, vocab, seed=1), _samples(10, vocab, seed=2)
    local.step(first)
    local.save(tmp_path / "local-v1", tiny_model_dir)
    local.step(second)
    kept = {k: v.clone() for k, v in local.model.state_dict().items()}
    fresh = LocalEngine(tmp_path / "local-v1", 1, cfg)  # same weights, AdamW from zero
    fresh.step(second)
    restarted = fresh.model.state_dict()
    gap = (kept["lm_head.weight"] - restarted["lm_head.weight"]).abs().median().item()
    assert gap > 0.2 * LR, "fresh and resumed AdamW agree: the comparison is vacuous"

    def fsdp(ckpt: Path, version: int, samples, out: Path, **kw) -> dict:
        return one_step(
            ckpt,
            version,
            cfg.model_dump(),
            samples,
            out,
            tiny_model_dir,
            world_size=2,
            parallel={"packing": True, "pack_tokens": 64},
            timeout_s=600,
            **kw,
        )

    opt = tmp_path / "optimizer-fsdp"
    m1 = fsdp(tiny_model_dir, 0, first, tmp_path / "v1", optimizer_out=opt / "v1")
    assert m1["optimizer_resumed"] == 0  # nothing was asked for: no warning either
    assert json.loads((opt / "v1" / "meta.json").read_text()) == {"version": 1, "world_size": 2}
    m2 = fsdp(
        tmp_path / "v1",
        1,
        second,
        tmp_path / "v2",
        optimizer_in=opt / "v1",
        optimizer_out=opt / "v2",
    )
    assert m2["optimizer_resumed"] == 1 and m2["version"] == 2
    _assert_close(_weights(tmp_path / "v2"), kept, 1e-5)

    import shutil

    shutil.rmtree(opt / "v1")
    caplog.clear()
    with caplog.at_level("WARNING", logger="trainer.resident"):
        m3 = fsdp(tmp_path / "v1", 1, second, tmp_path / "v2-fresh", optimizer_in=opt / "v1")
    assert m3["optimizer_resumed"] == 0 and m3["version"] == 2
    assert any("AdamW fresh" in r.getMessage() for r in caplog.records)
    _assert_close(_weights(tmp_path / "v2-fresh"), restarted, 1e-5)


def test_two_rank_fsdp_kl_and_entropy_match_local_engine(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """KL (k3) to the frozen base model and the entropy bonus: same loss, metrics and weights.

    The step starts from v1 (one plain step away from the base) so that the KL term is
    not zero and its gradient reaches every weight.
    """
    base = LocalEngine(tiny_model_dir, 0, CFG)
    vocab = base.model.config.vocab_size
    base.step(_samples(10, vocab, seed=3))
    base.save(tmp_path / "v1", tiny_model_dir)
    cfg = CFG.model_copy(update={"kl_coef": 0.5, "kl_estimator": "k3", "entropy_coef": 0.01})
    local = LocalEngine(tmp_path / "v1", 1, cfg, reference_dir=tiny_model_dir)
    samples = _samples(10, vocab, seed=4)
    expected = local.step(samples)
    assert expected["kl_ref"] > 1e-6 and expected["entropy"] > 0

    metrics = one_step(
        tmp_path / "v1",
        1,
        cfg.model_dump(),
        samples,
        tmp_path / "v2",
        tiny_model_dir,
        world_size=2,
        parallel={"packing": True, "pack_tokens": 64},
        reference_dir=tiny_model_dir,
        timeout_s=600,
    )
    assert metrics["loss"] == pytest.approx(expected["loss"], abs=1e-6)
    for key in ("kl_ref", "entropy", "clip_frac", "approx_kl", "iw_mean"):
        assert metrics[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
    assert metrics["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    _assert_close(_weights(tmp_path / "v2"), local.model.state_dict(), 1e-5)


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


def test_local_and_fsdp_engines_report_the_same_metrics(tiny_model_dir: Path) -> None:
    """In-process, one rank, padded micro-batches like the local engine: the same metric keys
    (the FSDP engine used to drop the advantage statistics), and the same values but timing."""
    from trainer.config import ParallelConfig
    from trainer.engine import METRICS
    from trainer.fsdp_engine import FsdpEngine

    cfg = CFG.model_copy(update={"kl_coef": 0.1})
    local = LocalEngine(tiny_model_dir, 0, cfg, reference_dir=tiny_model_dir)
    samples = _samples(6, local.model.config.vocab_size, seed=5)
    expected = local.step(samples)
    engine = FsdpEngine(
        tiny_model_dir, 0, cfg, ParallelConfig(packing=False), reference_dir=tiny_model_dir
    )
    try:
        got = engine.step(samples)
    finally:
        engine.close()
    adv = {"adv_mean", "adv_std", "adv_min", "adv_max"}
    assert set(got) == set(expected) == {*METRICS, "kl_ref", *adv}
    for key in sorted(set(expected) - {"train_seconds", "tokens_per_s"}):
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
    assert got["micro_batches"] == 2 and got["world_size"] == 1 and got["tokens"] > 30


def test_fsdp_optimizer_state_is_used_only_for_its_version(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """In-process, one rank: save after v0 -> v1, resume at v1, refuse at v2 (fresh AdamW)."""
    from trainer.fsdp_engine import FsdpEngine

    samples = _samples(4, 64)
    engine = FsdpEngine(tiny_model_dir, 0, CFG)
    try:
        engine.step(samples)
        engine.save(tmp_path / "v1", tiny_model_dir)
        engine.save_optimizer(tmp_path / "opt")
        saved = engine.optimizer.state_dict()["state"]
    finally:
        engine.close()
    assert not (tmp_path / "opt.tmp").exists()
    for version, expected in ((1, True), (2, False)):
        again = FsdpEngine(tmp_path / "v1", version, CFG)
        try:
            assert again.load_optimizer(tmp_path / "opt") is expected
            state = again.optimizer.state_dict()["state"]
            if expected:
                first = next(iter(saved))
                mine = state[first]["exp_avg"]
                mine = mine.full_tensor() if hasattr(mine, "full_tensor") else mine
                want = saved[first]["exp_avg"]
                want = want.full_tensor() if hasattr(want, "full_tensor") else want
                assert torch.equal(mine, want) and float(state[first]["step"]) == 1
            else:
                assert state == {}
        finally:
            again.close()


def test_a_failing_step_raises_with_the_ranks_stderr(tiny_model_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "not-a-model"}')
    with pytest.raises(ResidentGroupError) as info:
        one_step(
            broken,
            0,
            CFG.model_dump(),
            _samples(4, 64),
            tmp_path / "v1",
            tiny_model_dir,
            world_size=2,
            timeout_s=300,
        )
    message = str(info.value)
    assert "resident group start failed" in message  # the stream ended, or torchrun exited
    # the ranks' own stderr files are attached (a rank killed early may have written nothing)
    assert "/attempt_0/0/stderr.log" in message
    assert "not-a-model" in message
    assert not (tmp_path / "v1").exists()


def test_a_missing_checkpoint_fails_before_launching(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        one_step(tmp_path / "nope", 0, CFG, [], tmp_path / "v1", tmp_path, 2)


def test_nccl_without_cuda_is_a_config_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: nccl is a valid choice here")
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("nccl")
    assert resolve_backend("auto") == "gloo"


def _gpus(n: int) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        torch.cuda.device_count() < n, reason=f"needs {n} CUDA device(s) for NCCL"
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("world_size", "param_dtype", "loss_tol", "grad_norm_rel"),
    [
        pytest.param(1, "float32", 1e-4, 1e-4, marks=_gpus(1), id="1-float32-unsharded"),
        pytest.param(1, "bfloat16", 1e-3, 2e-2, marks=_gpus(1), id="1-bfloat16-fully-sharded"),
        pytest.param(2, "float32", 1e-4, 1e-3, marks=_gpus(2), id="2-float32-sharded"),
    ],
)
def test_nccl_step_matches_local_engine(
    tiny_model_dir: Path,
    tmp_path: Path,
    world_size: int,
    param_dtype: str,
    loss_tol: float,
    grad_norm_rel: float,
) -> None:
    """NCCL ranks on CUDA through torchrun (TF32 and other GPU kernels: looser bounds than
    the gloo tests). One float32 rank runs unsharded (`FsdpEngine.shards`); bfloat16 params
    go through `fully_shard`'s mixed-precision policy, so that case is the FSDP2 path on
    one GPU, with a bound for bfloat16 rounding."""
    local = LocalEngine(tiny_model_dir, 0, CFG)
    samples = _samples(10, local.model.config.vocab_size)
    expected = local.step(samples)
    metrics = one_step(
        tiny_model_dir,
        0,
        CFG.model_dump(),
        samples,
        tmp_path / "v1",
        tiny_model_dir,
        world_size=world_size,
        parallel={"backend": "nccl", "param_dtype": param_dtype},
        timeout_s=600,
    )
    assert metrics["world_size"] == world_size and metrics["version"] == 1
    assert metrics["tokens"] == expected["tokens"] and metrics["tokens"] > 100
    assert metrics["loss"] == pytest.approx(expected["loss"], abs=loss_tol)
    assert metrics["grad_norm"] == pytest.approx(expected["grad_norm"], rel=grad_norm_rel)
    assert (tmp_path / "v1" / "model.safetensors").is_file()


def test_one_float32_rank_runs_unsharded_and_writes_the_local_lora_adapter(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """In-process, one rank: nothing is sharded (`FsdpEngine.shards`), and a LoRA step with
    the KL term writes the local engine's adapter."""
    from torch.distributed.tensor import DTensor

    from trainer.fsdp_engine import FsdpEngine

    cfg = CFG.model_copy(update={"lora_rank": 4, "kl_coef": 0.05, "learning_rate": 1e-2})
    samples = _samples(6, 300, seed=6)
    local = LocalEngine(tiny_model_dir, 0, cfg, reference_dir=tiny_model_dir)
    local.step(samples)
    local.save(tmp_path / "local", tiny_model_dir)
    engine = FsdpEngine(tiny_model_dir, 0, cfg, reference_dir=tiny_model_dir)
    try:
        assert not engine.shards
        assert not any(isinstance(p, DTensor) for p in engine.policy.parameters())
        engine.step(samples)
        engine.save(tmp_path / "fsdp", tiny_model_dir)
    finally:
        engine.close()
    from safetensors.torch import load_file

    mine = load_file(tmp_path / "fsdp" / "adapter_model.safetensors")
    theirs = load_file(tmp_path / "local" / "adapter_model.safetensors")
    assert mine.keys() == theirs.keys() and mine
    for key, value in mine.items():
        assert torch.allclose(value, theirs[key], atol=1e-5), key
    # LoRA's B starts at zero: a non-zero B means the step trained the adapter
    assert any(v.abs().max() > 0 for k, v in mine.items() if "lora_B" in k)
