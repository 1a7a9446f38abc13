"""PPO-clip loss against hand-computed numbers, gradients included."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.losses.ppo import ppo_clip_loss

OLD = -1.0


def _t(values: list[float] | list[list[float]]) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64)
    return t if t.dim() == 2 else t[None, :]


def _logp_for(ratios: list[float]) -> torch.Tensor:
    """Current logprobs giving exactly these ratios against old logprobs of OLD."""
    return _t([OLD + math.log(r) for r in ratios]).requires_grad_(True)


def _loss(ratios, advs, mask=None, **kw):
    logp = _logp_for(ratios)
    old = torch.full_like(logp, OLD)
    m = _t(mask) if mask is not None else torch.ones_like(old)
    loss, metrics = ppo_clip_loss(logp, old, _t(advs), m, **kw)
    loss.backward()
    return loss, metrics, logp.grad


def test_ratio_inside_clip_range_is_plain_policy_gradient() -> None:
    loss, metrics, grad = _loss([1.1], [2.0])
    assert loss.item() == pytest.approx(-2.2)
    # d(-ratio * A)/d logp = -ratio * A
    assert grad[0, 0].item() == pytest.approx(-2.2)
    assert metrics["clip_frac"] == 0.0


def test_ratio_above_range_with_positive_advantage_is_clipped() -> None:
    loss, metrics, grad = _loss([1.5], [1.0])
    assert loss.item() == pytest.approx(-1.2)  # -(1 + 0.2) * 1
    assert grad[0, 0].item() == 0.0
    assert metrics["clip_frac"] == 1.0


def test_ratio_below_range_with_negative_advantage_is_clipped() -> None:
    loss, metrics, grad = _loss([0.5], [-1.0])
    assert loss.item() == pytest.approx(0.8)  # -(1 - 0.2) * -1
    assert grad[0, 0].item() == 0.0
    assert metrics["clip_frac"] == 1.0


def test_ratio_above_range_with_negative_advantage_keeps_its_gradient() -> None:
    # The pessimistic minimum picks the unclipped term: the update is not cut off.
    loss, _, grad = _loss([1.5], [-1.0])
    assert loss.item() == pytest.approx(1.5)
    assert grad[0, 0].item() == pytest.approx(1.5)


def test_ratio_below_range_with_positive_advantage_keeps_its_gradient() -> None:
    loss, _, grad = _loss([0.5], [1.0])
    assert loss.item() == pytest.approx(-0.5)
    assert grad[0, 0].item() == pytest.approx(-0.5)


def test_mask_excludes_positions_from_loss_gradient_and_denominator() -> None:
    # The masked token has a huge ratio and advantage; it must not count anywhere.
    loss, metrics, grad = _loss([1.1, 1.0, 9.0], [2.0, -1.0, 100.0], mask=[1.0, 1.0, 0.0])
    assert loss.item() == pytest.approx((-2.2 + 1.0) / 2)
    assert grad[0].tolist() == pytest.approx([-2.2 / 2, 1.0 / 2, 0.0])
    assert metrics["ratio_max"] == pytest.approx(1.1)
    assert metrics["ratio_mean"] == pytest.approx(1.05)


def test_explicit_normaliser_replaces_the_token_count() -> None:
    loss, _, grad = _loss([1.1, 1.0], [2.0, -1.0], normaliser=10.0)
    assert loss.item() == pytest.approx((-2.2 + 1.0) / 10)
    assert grad[0].tolist() == pytest.approx([-0.22, 0.1])


def test_micro_batches_with_a_shared_normaliser_add_up_to_the_full_batch() -> None:
    ratios = [[1.1, 0.9, 1.3], [1.0, 0.7, 1.05]]
    advs = [[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]]
    logp = _t([[OLD + math.log(r) for r in row] for row in ratios])
    old = torch.full_like(logp, OLD)
    mask = _t([[1.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    full, _ = ppo_clip_loss(logp, old, _t(advs), mask)
    parts = [
        ppo_clip_loss(
            logp[i : i + 1], old[i : i + 1], _t(advs)[i : i + 1], mask[i : i + 1], normaliser=5.0
        )[0]
        for i in range(2)
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item())


def test_seq_mean_averages_each_sequence_then_the_sequences() -> None:
    # seq 0: two tokens, per-token losses -2.2 and +1.0 -> mean -0.6
    # seq 1: one token (second one masked), loss -1.2 (clipped)
    logp = _t([[OLD + math.log(1.1), OLD], [OLD + math.log(1.5), OLD + 5.0]])
    old = torch.full_like(logp, OLD)
    adv = _t([[2.0, -1.0], [1.0, 1.0]])
    mask = _t([[1.0, 1.0], [1.0, 0.0]])
    loss, _ = ppo_clip_loss(logp, old, adv, mask, agg="seq_mean")
    assert loss.item() == pytest.approx((-0.6 + -1.2) / 2)
    token_mean, _ = ppo_clip_loss(logp, old, adv, mask)
    assert token_mean.item() == pytest.approx((-2.2 + 1.0 - 1.2) / 3)
    weighted, _ = ppo_clip_loss(logp, old, adv, mask, agg="seq_mean", seq_weight=4.0)
    assert weighted.item() == pytest.approx((-0.6 + -1.2) / 4)


def test_unknown_aggregation_is_rejected() -> None:
    x = _t([0.0])
    with pytest.raises(ValueError, match="aggregation"):
        ppo_clip_loss(x, x, x, x, agg="sum")


@pytest.mark.parametrize("bad", [float("-inf"), float("nan"), float("inf")])
def test_non_finite_old_logprobs_are_masked(bad: float) -> None:
    logp = _t([OLD + math.log(1.1), OLD]).requires_grad_(True)
    old = _t([OLD, bad])
    loss, metrics = ppo_clip_loss(logp, old, _t([2.0, 5.0]), torch.ones_like(old))
    assert math.isfinite(loss.item())
    assert loss.item() == pytest.approx(-2.2)  # only the finite token, denominator 1
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[0].tolist() == pytest.approx([-2.2, 0.0])
    assert all(math.isfinite(v) for v in metrics.values())


def test_huge_log_ratio_is_clamped_before_exp() -> None:
    logp = _t([OLD + 500.0]).requires_grad_(True)
    loss, metrics = ppo_clip_loss(logp, _t([OLD]), _t([-1.0]), _t([1.0]))
    # log-ratio clamped to 20: the unclipped term exp(20) * -1 wins the minimum
    assert loss.item() == pytest.approx(math.exp(20.0))
    assert math.isfinite(metrics["approx_kl"])


def test_asymmetric_clip_eps_high() -> None:
    # ratio 1.25 with A=1: inside [0.8, 1.28], clipped at 1.2 with the symmetric default
    loss_hi, m_hi, grad_hi = _loss([1.25], [1.0], clip_eps_high=0.28)
    assert loss_hi.item() == pytest.approx(-1.25)
    assert grad_hi[0, 0].item() == pytest.approx(-1.25)
    assert m_hi["clip_frac"] == 0.0
    loss_sym, _, grad_sym = _loss([1.25], [1.0])
    assert loss_sym.item() == pytest.approx(-1.2)
    assert grad_sym[0, 0].item() == 0.0
    # eps_low still applies below 1
    loss_lo, _, _ = _loss([0.5], [-1.0], clip_eps_low=0.1, clip_eps_high=0.28)
    assert loss_lo.item() == pytest.approx(0.9)


def test_metrics_clip_frac_and_approx_kl() -> None:
    ratios = [1.1, 1.5, 0.5, 1.0]
    advs = [1.0, 1.0, -1.0, 1.0]
    _, metrics, _ = _loss(ratios, advs)
    assert metrics["clip_frac"] == pytest.approx(2 / 4)
    # k3 estimator: mean of (r - 1) - log r over the masked tokens
    kl = sum((r - 1) - math.log(r) for r in ratios) / 4
    assert metrics["approx_kl"] == pytest.approx(kl)
    assert metrics["ratio_mean"] == pytest.approx(sum(ratios) / 4)
    assert metrics["ratio_max"] == pytest.approx(1.5)


def test_identical_policies_give_ratio_one_and_no_kl() -> None:
    logp = _t([[-0.3, -2.0, -4.5]])
    loss, metrics = ppo_clip_loss(logp, logp.clone(), _t([[0.5, 0.5, 0.5]]), torch.ones_like(logp))
    assert loss.item() == pytest.approx(-0.5)
    assert metrics["approx_kl"] == 0.0
    assert metrics["clip_frac"] == 0.0
    assert metrics["ratio_mean"] == 1.0


def test_all_masked_batch_gives_zero_loss() -> None:
    logp = _t([[-1.0, -2.0]]).requires_grad_(True)
    loss, metrics = ppo_clip_loss(logp, logp.detach() - 1, _t([[1.0, 1.0]]), _t([[0.0, 0.0]]))
    assert loss.item() == 0.0
    assert metrics["ratio_max"] == 1.0
