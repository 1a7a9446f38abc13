"""The gateway's BackendPool serving pinned versions beside a run's current one.

Versions 1 are written by the trainer's own engine from the `tiny` model: a
full fine-tune and a LoRA adapter. A pinned version is served by its own
weights (greedy tokens equal a float32 `from_pretrained` of its checkpoint),
reports that version, never moves with the run, stays within its bound (least
recently used released first) and goes with its run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gateway.control import backends
from gateway.control.backends import BackendPool, PinUnsupported, RunServing, ServedWeights
from inference.backend import BackendError
from inference.types import GenerateRequest, SamplingParams
from tests.unit.test_lora_pool import _trained_adapter
from trainer.batch import Sample
from trainer.config import RunConfig
from trainer.local_engine import LocalEngine

PROMPT = [1, 5, 9, 13, 17]
TOKENS = 8


def _trained_full(model_dir: Path, out: Path) -> Path:
    """Version 1 of a full fine-tune of `model_dir`, a step large enough to move its greedy."""
    cfg = RunConfig(group_size=2, groups_per_step=1, micro_batch_size=2, learning_rate=5e-2)
    engine = LocalEngine(model_dir, 0, cfg, reference_dir=model_dir)
    ids = [5, 6, 7, 8, 9, 10]
    engine.step(
        [
            Sample(ids, [0, 0, 1, 1, 1, 1], [0, 0] + [-5.0] * 4, [0, 0] + [a] * 4, [1.0] * 6, 0)
            for a in (1.0, -1.0)
        ]
    )
    engine.save(out, model_dir)
    return out


@pytest.fixture(scope="module")
def full_v1(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _trained_full(tiny_model_dir, tmp_path_factory.mktemp("full") / "v1")


@pytest.fixture(scope="module")
def adapter_v1(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _trained_adapter(tiny_model_dir, tmp_path_factory.mktemp("lora") / "v1", seed=3)


@torch.no_grad()
def _reference(model_dir: Path, adapter: Path | None = None) -> list[int]:
    """Greedy tokens of a float32 transformers model (with `adapter`, through peft)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    ids = list(PROMPT)
    for _ in range(TOKENS):
        ids.append(int(model.eval()(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT) :]


async def _greedy(serving: RunServing) -> tuple[list[int], int]:
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0)
    r = await serving.backend.generate(GenerateRequest(PROMPT, params))
    return r.output_token_ids, r.policy_version


async def test_a_full_model_pin_is_a_bounded_copy_of_that_version(
    tiny_model_dir: Path, full_v1: Path
) -> None:
    v0, v1 = _reference(tiny_model_dir), _reference(full_v1)
    assert v0 != v1, "the step must move the greedy answer for this test to tell them apart"
    pool = BackendPool(max_batch_size=4, eval_pinned_copies=1)
    try:
        current = await pool.get("run", ServedWeights(tiny_model_dir, "local", 1, full_v1))
        pin0 = await pool.pinned("run", ServedWeights(tiny_model_dir, "local", 0, None))
        assert await _greedy(pin0) == (v0, 0)
        assert await _greedy(current) == (v1, 1)  # the run itself is untouched
        assert await pool.pinned("run", ServedWeights(tiny_model_dir, "local", 0, None)) is pin0
        assert pool.loaded().keys() == {"run"} and pool.serving_version("run") == 1

        # a second pinned version needs the one copy allowed: the older pin is closed
        pin1 = await pool.pinned("run", ServedWeights(tiny_model_dir, "local", 1, full_v1))
        assert await _greedy(pin1) == (v1, 1)
        assert pin1.backend is not current.backend  # a copy, which the run's swaps never touch
        assert pool.pinned_versions() == {"run": [1]}
        assert not await pin0.backend.health()

        await pool.unload("run")  # the run's pins go with it
        assert pool.pinned_versions() == {} and not await pin1.backend.health()
    finally:
        await pool.close()


async def test_least_recently_used_copy_is_the_one_released(
    tiny_model_dir: Path, full_v1: Path
) -> None:
    pool = BackendPool(max_batch_size=4, eval_pinned_copies=2)
    try:
        a0 = await pool.pinned("a", ServedWeights(tiny_model_dir, "local", 0, None))
        b1 = await pool.pinned("b", ServedWeights(tiny_model_dir, "local", 1, full_v1))
        assert (
            await pool.pinned("a", ServedWeights(tiny_model_dir, "local", 0, None)) is a0
        )  # a used last
        await pool.pinned("c", ServedWeights(tiny_model_dir, "local", 0, None))
        assert pool.pinned_versions() == {"a": [0], "c": [0]}
        assert not await b1.backend.health() and await a0.backend.health()
    finally:
        await pool.close()
    assert pool.pinned_versions() == {} and not await a0.backend.health()


async def test_pins_that_cannot_be_served_are_refused(tiny_model_dir: Path) -> None:
    pool = BackendPool(eval_pinned_copies=0)
    try:
        with pytest.raises(PinUnsupported, match="eval_pinned_copies is 0"):
            await pool.pinned("run", ServedWeights(tiny_model_dir, "local", 0, None))
        for kind in ("vllm", "sglang"):  # servers hold one set of weights per full-model run
            with pytest.raises(PinUnsupported, match=f"{kind} servers"):
                await pool.pinned("run", ServedWeights(tiny_model_dir, kind, 0, None))
        with pytest.raises(ValueError, match="eval_pinned_copies"):
            BackendPool(eval_pinned_copies=-1)
    finally:
        await pool.close()


async def test_a_lora_pin_is_its_own_adapter_on_the_shared_base(
    tiny_model_dir: Path, adapter_v1: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    v0, v1 = _reference(tiny_model_dir), _reference(tiny_model_dir, adapter_v1)
    assert v0 != v1
    pool = BackendPool(max_batch_size=4, eval_pinned_copies=0)  # adapters need no copies
    try:
        run = await pool.get("run", ServedWeights(tiny_model_dir, "local", 0, None, lora=True))
        pin1 = await pool.pinned(
            "run", ServedWeights(tiny_model_dir, "local", 1, adapter_v1, lora=True)
        )
        assert await _greedy(pin1) == (v1, 1)
        assert await _greedy(run) == (v0, 0)  # the run's own adapter slot is untouched
        base = run.backend.backend
        assert pin1.backend.backend is base and base.adapter_version("run@v1") == 1
        assert base.adapter_version("run") is None

        # the run moves to v1 and the pin of v0 serves the base model
        await run.backend.load_weights(adapter_v1, 1)
        pin0 = await pool.pinned("run", ServedWeights(tiny_model_dir, "local", 0, None, lora=True))
        assert await _greedy(pin0) == (v0, 0) and await _greedy(run) == (v1, 1)

        monkeypatch.setattr(backends, "MAX_PINNED_ADAPTERS", 2)
        other = await pool.get("other", ServedWeights(tiny_model_dir, "local", 0, None, lora=True))
        await pool.pinned("other", ServedWeights(tiny_model_dir, "local", 1, adapter_v1, lora=True))
        assert pool.pinned_versions() == {"run": [0], "other": [1]}  # run@v1: least recent
        assert base.adapter_version("run@v1") is None
        with pytest.raises(BackendError, match="not loaded"):  # never the base's answer
            await _greedy(pin1)

        await pool.unload("run")
        await pool.unload("other")
        assert pool.pinned_versions() == {} and pool.shared_bases() == {}
        assert not await other.backend.health()  # the last user out closed the base
    finally:
        await pool.close()
