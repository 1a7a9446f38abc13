"""LoRA engines of one worker share one frozen base (`trainer.shared_base`): the weights are
held once, and each engine trains exactly as it would on a copy of its own."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.unit.test_lora_engine import _cfg, _samples
from trainer.local_engine import LocalEngine
from trainer.shared_base import SharedBases


def _base_tensors(engine: LocalEngine) -> dict[str, torch.Tensor]:
    return {n: p for n, p in engine.model.named_parameters() if "lora_" not in n}


def test_engines_share_the_base_weights_and_train_as_alone(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    bases = SharedBases()
    shared = [
        LocalEngine(tiny_model_dir, 0, _cfg(seed=s), reference_dir=tiny_model_dir, bases=bases)
        for s in (1, 2)
    ]
    alone = [
        LocalEngine(tiny_model_dir, 0, _cfg(seed=s), reference_dir=tiny_model_dir) for s in (1, 2)
    ]
    assert len(bases) == 1
    a, b = (_base_tensors(e) for e in shared)
    assert a.keys() == b.keys() and all(a[n].data_ptr() == b[n].data_ptr() for n in a)
    assert all(a[n].data_ptr() != _base_tensors(alone[0])[n].data_ptr() for n in a)
    before = {n: t.detach().clone() for n, t in a.items()}
    # steps interleaved on the shared base equal the same steps on separate copies
    timing = ("train_seconds", "tokens_per_s")
    for _ in range(2):
        for s, o in zip(shared, alone, strict=True):
            mine, theirs = s.step(_samples()), o.step(_samples())
            assert {k: v for k, v in mine.items() if k not in timing} == {
                k: v for k, v in theirs.items() if k not in timing
            }
    for s, o in zip(shared, alone, strict=True):
        mine = {n: p for n, p in s.model.named_parameters() if "lora_" in n}
        theirs = dict(o.model.named_parameters())
        assert mine and all(torch.equal(p, theirs[n]) for n, p in mine.items())
    assert all(torch.equal(t, before[n]) for n, t in a.items())  # the base never moves
    # the two adapters are their own: each engine saves its adapter only
    shared[0].save(tmp_path / "one", tiny_model_dir)
    shared[1].save(tmp_path / "two", tiny_model_dir)
    one = (tmp_path / "one" / "adapter_model.safetensors").read_bytes()
    assert one != (tmp_path / "two" / "adapter_model.safetensors").read_bytes()
