"""The gateway's BackendPool: LoRA runs on one base model share one in-process backend."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gateway.control.backends import BackendPool, ServedWeights
from inference.backend import BackendError
from inference.lora_view import AdapterView
from inference.types import GenerateRequest, SamplingParams
from trainer.config import RunConfig
from trainer.local_engine import LocalEngine
from trainer.lora import is_adapter_dir


def _trained_adapter(model_dir: Path, out: Path, seed: int) -> Path:
    """Version 1 of a LoRA run, written by the trainer's own engine."""
    from trainer.batch import Sample

    cfg = RunConfig(
        group_size=2, groups_per_step=1, micro_batch_size=2, learning_rate=5e-2, lora_rank=4
    )
    cfg = cfg.model_copy(update={"seed": seed})
    engine = LocalEngine(model_dir, 0, cfg, reference_dir=model_dir)
    ids = [5, 6, 7, 8, 9, 10]
    engine.step(
        [
            Sample(ids, [0, 0, 1, 1, 1, 1], [0, 0] + [-5.0] * 4, [0, 0] + [a] * 4, [1.0] * 6, 0)
            for a in (1.0, -1.0)
        ]
    )
    engine.save(out, model_dir)
    assert is_adapter_dir(out)
    return out


@pytest.fixture(scope="module")
def adapter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _trained_adapter(tiny_model_dir, tmp_path_factory.mktemp("lora") / "v1", seed=3)


async def _greedy(pool_serving, prompt: list[int]) -> tuple[list[int], int]:
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=1, top_k=1)
    r = await pool_serving.backend.generate(GenerateRequest(prompt, params))
    return r.output_token_ids, r.policy_version


async def test_lora_runs_share_one_base_and_unload_only_their_adapter(
    tiny_model_dir: Path, adapter: Path
) -> None:
    pool = BackendPool(max_batch_size=8)
    prompt = [1, 5, 9, 13, 17]
    try:
        a = await pool.get("run_a", ServedWeights(tiny_model_dir, "local", 1, adapter, lora=True))
        b = await pool.get(
            "run_b", ServedWeights(tiny_model_dir, "local", 0, tiny_model_dir, lora=True)
        )
        c = await pool.get(
            "run_c", ServedWeights(tiny_model_dir, "local", 0, tiny_model_dir, lora=True)
        )
        full = await pool.get("run_full", ServedWeights(tiny_model_dir, "local", 0, tiny_model_dir))
        assert pool.shared_bases() == {tiny_model_dir.resolve(): {"run_a", "run_b", "run_c"}}
        assert isinstance(a.backend, AdapterView) and a.backend.backend is b.backend.backend
        assert full.backend is not a.backend.backend  # a full fine-tune has weights of its own
        assert [pool.serving_version(r) for r in ("run_a", "run_b", "run_c")] == [1, 0, 0]

        base = await _greedy(full, prompt)
        assert await _greedy(b, prompt) == base and await _greedy(c, prompt) == base
        trained = await _greedy(a, prompt)
        assert trained[1] == 1 and trained[0] != base[0]

        # run_b's hot swap loads its adapter; run_a and run_c answer as before
        await b.backend.load_weights(adapter, 1)
        assert await _greedy(b, prompt) == trained
        assert await _greedy(a, prompt) == trained and await _greedy(c, prompt) == base

        await pool.unload("run_a")  # stop or delete: run_a's adapter goes, nothing else
        assert a.backend.backend.adapter_version("run_a") is None
        assert await _greedy(b, prompt) == trained and await _greedy(c, prompt) == base
        await pool.unload("run_b")
        await pool.unload("run_c")
        assert pool.shared_bases() == {}  # the last LoRA run out closes the shared base
        assert not await c.backend.health()
    finally:
        await pool.close()


async def test_a_lora_view_refuses_weights_that_are_not_an_adapter(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    pool = BackendPool()
    try:
        a = await pool.get(
            "run_a", ServedWeights(tiny_model_dir, "local", 0, tiny_model_dir, lora=True)
        )
        with pytest.raises(BackendError, match="not a LoRA adapter"):
            await a.backend.load_weights(tiny_model_dir, 1)
        assert a.backend.version == 0
        missing = tmp_path / "v3"
        with pytest.raises(OSError):  # a restarted gateway on a pruned adapter: no half state
            shutil.rmtree(missing, ignore_errors=True)
            await pool.get("run_b", ServedWeights(tiny_model_dir, "local", 3, missing, lora=True))
        assert pool.shared_bases() == {tiny_model_dir.resolve(): {"run_a"}}
    finally:
        await pool.close()
