"""GRPO, Dr.GRPO, RLOO, decoupled PPO, KL and entropy as configurations of one loss."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from trainer.advantages import group_advantage
from trainer.config import RunConfig
from trainer.engine import learning_rate
from trainer.losses.kl import kl_penalty
from trainer.losses.policy import policy_loss


def test_advantage_estimators_by_hand() -> None:
    g = [1.0, 0.0, 0.0]
    mean, std = 1 / 3, math.sqrt(2 / 9)
    assert group_advantage(1.0, g, "grpo", 0.0) == pytest.approx((1 - mean) / std)
    assert group_advantage(1.0, g, "drgrpo", 0.0) == pytest.approx(2 / 3)
    # RLOO: own return minus the mean of the others
    assert group_advantage(1.0, g, "rloo", 0.0) == pytest.approx(1.0 - 0.0)
    assert group_advantage(0.0, g, "rloo", 0.0) == pytest.approx(0.0 - 0.5)
    with pytest.raises(ValueError, match="advantage_estimator"):
        group_advantage(1.0, g, "nope", 0.0)


def _one_token(p: float, behaviour_p: float, adv: float = 1.0):
    logp = torch.tensor([[math.log(p)]], requires_grad=True)
    old = torch.tensor([[math.log(behaviour_p)]])
    return logp, old, torch.tensor([[adv]]), torch.ones(1, 1)


@pytest.mark.parametrize(("cap", "weight"), [(5.0, 2.0), (1.5, 1.5)])
def test_decoupled_ppo_weights_by_the_capped_behaviour_ratio(cap: float, weight: float) -> None:
    logp, old, adv, mask = _one_token(0.5, 0.25)  # pi_prox / pi_behaviour = 2
    cfg = RunConfig(behaviour_weight_cap=cap)
    loss, m = policy_loss(logp, old, adv, mask, cfg, n_tokens=1, n_sequences=1)
    loss.backward()
    assert float(loss) == pytest.approx(-weight)
    # at the proximal point the ratio is 1 (inside the clip): d loss / d logp = -w * A
    assert float(logp.grad) == pytest.approx(-weight)
    assert m["iw_mean"] == pytest.approx(weight)


def test_plain_ppo_clips_against_the_behaviour_policy() -> None:
    logp, old, adv, mask = _one_token(0.5, 0.25)  # ratio 2 > 1.2: clipped, no gradient
    loss, m = policy_loss(logp, old, adv, mask, RunConfig(), n_tokens=1, n_sequences=1)
    loss.backward()
    assert float(loss) == pytest.approx(-1.2)
    assert float(logp.grad) == 0.0 and m["clip_frac"] == 1.0


def test_kl_estimators_by_hand() -> None:
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert float(kl_penalty(logp, ref, "k1")) == pytest.approx(math.log(2))
    # r = log(0.25 / 0.5) = -log 2;  k3 = exp(r) - r - 1 = 0.5 + log 2 - 1
    assert float(kl_penalty(logp, ref, "k3")) == pytest.approx(0.5 + math.log(2) - 1)


def test_kl_and_entropy_terms_enter_the_loss() -> None:
    logp, old, adv, mask = _one_token(0.5, 0.5, adv=0.0)  # no policy-gradient term
    ref = torch.tensor([[math.log(0.25)]])
    entropy = torch.tensor([[0.7]])
    cfg = RunConfig(kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01)
    loss, m = policy_loss(
        logp, old, adv, mask, cfg, n_tokens=1, n_sequences=1, ref_logp=ref, entropy=entropy
    )
    assert float(loss) == pytest.approx(0.1 * math.log(2) - 0.01 * 0.7)
    assert m["kl_ref"] == pytest.approx(math.log(2)) and m["entropy"] == pytest.approx(0.7)


def test_constant_normaliser_ignores_answer_length() -> None:
    logp = torch.zeros(2, 4, requires_grad=True)
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 0, 0, 0]])  # a long and a short answer
    adv = torch.ones(2, 4)
    cfg = RunConfig(advantage_estimator="drgrpo", loss_agg="constant", constant_normaliser=8)
    loss, _ = policy_loss(logp, logp.detach(), adv, mask, cfg, n_tokens=5, n_sequences=2)
    assert float(loss) == pytest.approx(-5 / (2 * 8))


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"advantage_estimator": "drgrpo"}, "loss_agg"),
        ({"loss_agg": "constant"}, "constant_normaliser"),
        ({"world_size": 2}, "engine"),
        ({"gamma": 0.9}, "discounted"),
        ({"behaviour_weight_cap": 0.5}, "behaviour_weight_cap"),
        ({"learning_rte": 1e-5}, "learning_rte"),
    ],
)
def test_invalid_combinations_name_the_option(fields: dict, needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        RunConfig(**fields)


def test_learning_rate_warmup() -> None:
    cfg = RunConfig(learning_rate=1e-4, lr_warmup_steps=4)
    assert [learning_rate(cfg, v) for v in range(5)] == pytest.approx(
        [2.5e-5, 5e-5, 7.5e-5, 1e-4, 1e-4]
    )


def test_local_engine_with_kl_and_entropy_on_the_tiny_model(tiny_model_dir) -> None:
    from trainer.batch import Sample
    from trainer.local_engine import LocalEngine

    cfg = RunConfig(
        kl_coef=0.05,
        entropy_coef=0.001,
        group_size=2,
        groups_per_step=1,
        micro_batch_size=2,
        learning_rate=1e-3,
    )
    engine = LocalEngine(tiny_model_dir, 0, cfg, reference_dir=tiny_model_dir)
    samples = [
        Sample([5, 6, 7, 8], [0, 0, 1, 1], [0, 0, -5.0, -5.0], [0, 0, a, a], [1.0] * 4, 0)
        for a in (1.0, -1.0)
    ]
    m1 = engine.step(samples)
    assert m1["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # the policy starts at the reference
    assert m1["entropy"] > 0
    m2 = engine.step(samples)
    assert m2["kl_ref"] > 0  # after one update the policy has moved away from it


def test_optimizer_state_resumes_for_the_right_version(tiny_model_dir, tmp_path) -> None:
    from trainer.batch import Sample
    from trainer.local_engine import LocalEngine

    cfg = RunConfig(group_size=2, groups_per_step=1, micro_batch_size=2, learning_rate=1e-3)
    engine = LocalEngine(tiny_model_dir, 0, cfg)
    samples = [Sample([5, 6, 7], [0, 1, 1], [0, -4.0, -4.0], [0, 1.0, 1.0], [1.0] * 3, 0)] * 2
    engine.step(samples)
    engine.save(tmp_path / "v1", tiny_model_dir)
    engine.save_optimizer(tmp_path / "optimizer")
    resumed = LocalEngine(tmp_path / "v1", 1, cfg)
    assert resumed.load_optimizer(tmp_path / "optimizer")
    a = engine.optimizer.state_dict()["state"]
    b = resumed.optimizer.state_dict()["state"]
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k]["exp_avg"], b[k]["exp_avg"])
    stale = LocalEngine(tmp_path / "v1", 2, cfg)  # a different version: start fresh
    assert not stale.load_optimizer(tmp_path / "optimizer")


def test_local_engine_resumed_after_a_restart_equals_one_kept_in_memory(
    tiny_model_dir, tmp_path
) -> None:
    """What a restarted worker does (`InProcessRunner.engine_for`): v1 weights, AdamW from disk."""
    from trainer.batch import Sample
    from trainer.local_engine import LocalEngine

    cfg = RunConfig(group_size=2, groups_per_step=1, micro_batch_size=2, learning_rate=1e-3)
    samples = [
        Sample([5, 6, 7, 9], [0, 1, 1, 1], [0, -4.0, -4.0, -5.0], [0, a, a, a], [1.0] * 4, 0)
        for a in (1.0, -1.0)
    ]
    kept = LocalEngine(tiny_model_dir, 0, cfg)
    kept.step(samples)
    kept.save(tmp_path / "v1", tiny_model_dir)
    kept.save_optimizer(tmp_path / "optimizer")
    kept.step(samples)
    restarted = LocalEngine(tmp_path / "v1", 1, cfg)
    assert restarted.load_optimizer(tmp_path / "optimizer")
    restarted.step(samples)
    fresh = LocalEngine(tmp_path / "v1", 1, cfg)
    fresh.step(samples)
    a, b, c = (e.model.state_dict()["lm_head.weight"] for e in (kept, restarted, fresh))
    assert torch.allclose(a, b, atol=1e-7)
    assert (a - c).abs().max() > 1e-4  # a fresh AdamW would have moved elsewhere
