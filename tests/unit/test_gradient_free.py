"""Zero-advantage samples (zero-variance groups trained under `zero_variance_groups: train`)
count in the step's denominator but are not forwarded: the update must be the one a full
pass over every sample gives, and the compute must not be spent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import trainer.engine as engine_module
from trainer.batch import Sample
from trainer.config import RunConfig
from trainer.engine import gradient_free


def _sample(advantage: float, n_out: int = 3) -> Sample:
    ids = [5, 6, 7] + [8 + i for i in range(n_out)]
    mask = [0, 0, 0] + [1] * n_out
    return Sample(
        ids,
        mask,
        [0.0] * 3 + [-4.0] * n_out,
        [0.0] * 3 + [advantage] * n_out,
        [1.0] * len(ids),
        0,
    )


def test_only_all_zero_advantages_without_kl_or_entropy_are_gradient_free() -> None:
    cfg = RunConfig()
    assert gradient_free(_sample(0.0), cfg)
    assert not gradient_free(_sample(0.5), cfg)
    assert not gradient_free(_sample(0.0), cfg.model_copy(update={"kl_coef": 0.1}))
    assert not gradient_free(_sample(0.0), cfg.model_copy(update={"entropy_coef": 0.01}))
    # advantages off the loss mask do not count
    s = _sample(0.0)
    s.advantages[0] = 3.0
    assert gradient_free(s, cfg)


def _step(tiny_model_dir: Path, samples: list[Sample], monkeypatch, skip: bool):
    from trainer.local_engine import LocalEngine

    if not skip:  # the reference: every sample forwarded, as before
        monkeypatch.setattr(engine_module, "gradient_free", lambda s, cfg: False)
    cfg = RunConfig(group_size=2, groups_per_step=3, micro_batch_size=2, learning_rate=1e-3)
    torch.manual_seed(0)
    engine = LocalEngine(tiny_model_dir, 0, cfg)
    metrics = engine.step(samples)
    monkeypatch.undo()
    params = [p.detach().clone() for p in engine.trained_parameters()]
    return metrics, params


@pytest.mark.parametrize("advantages", [(1.0, -1.0, 0.0, 0.0, 0.5, -0.5), (0.0,) * 6])
def test_the_update_equals_a_full_pass(tiny_model_dir: Path, monkeypatch, advantages) -> None:
    samples = [_sample(a, n_out=2 + i) for i, a in enumerate(advantages)]
    full_m, full_p = _step(tiny_model_dir, samples, monkeypatch, skip=False)
    skip_m, skip_p = _step(tiny_model_dir, samples, monkeypatch, skip=True)
    n_free = sum(1 for a in advantages if a == 0.0)
    assert skip_m["samples_gradient_free"] == n_free and full_m["samples_gradient_free"] == 0
    assert skip_m["tokens"] == full_m["tokens"]  # the same denominator
    assert skip_m["tokens_total"] < full_m["tokens_total"]  # fewer positions forwarded
    assert skip_m["loss"] == pytest.approx(full_m["loss"], abs=1e-6)
    assert skip_m["grad_norm"] == pytest.approx(full_m["grad_norm"], rel=1e-4, abs=1e-7)
    for a, b in zip(skip_p, full_p, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    if n_free == len(advantages):  # nothing had a gradient: AdamW still stepped, on zeros
        assert skip_m["micro_batches"] == 1
