"""PPO-clip policy loss using the stored behaviour logprobs for the ratio.

Shapes: every argument is [B, T] (B sequences, T positions); `mask` is 1 on
sampled tokens (the loss mask) and 0 on prompt and padding.

    ratio_t = exp(clamp(logp_t - old_logp_t, -20, 20))
    l_t     = -min(ratio_t * A_t, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A_t)

Aggregation ("token_mean", default): sum of l_t over all masked tokens
divided by `normaliser` (the number of masked tokens in the whole batch,
passed in so that micro-batches and ranks share one denominator; DAPO-style
token-level averaging). "seq_mean": each sequence's mean, then the mean over
sequences (the original GRPO formulation), weighted by `seq_weight`.
"constant" (Dr.GRPO, Liu et al. 2025): the sum over tokens divided by a
constant the caller passes as `normaliser` (sequences x a fixed token
budget), so long and short answers are not re-weighted by their length.

Departs from Schulman et al. (2017) in that `old_logp` comes from the
inference engine that sampled the tokens (decoupled, as in AReaL) rather
than from a second forward pass; non-finite log-ratios are masked out.
"""

from __future__ import annotations

import torch


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    normaliser: float | None = None,
    agg: str = "token_mean",
    seq_weight: float | None = None,
    behaviour_weight_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    per_token, mask, metrics = ppo_per_token(
        logp, old_logp, advantages, mask, clip_eps_low, clip_eps_high, behaviour_weight_cap
    )
    return aggregate(per_token, mask, agg, normaliser, seq_weight), metrics


def ppo_per_token(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
    behaviour_weight_cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """[B, T] clipped objective (negated), the effective mask, and metrics.

    With `behaviour_weight_cap` (decoupled PPO, Hilton et al. 2022; AReaL): the
    ratio is taken against the proximal policy (the current weights, detached,
    since one optimizer step is taken per batch) and each token is weighted by
    min(pi_prox / pi_behaviour, cap), so samples from an older version count
    less instead of being clipped against the wrong policy.
    """
    mask = mask.to(logp.dtype)
    finite = torch.isfinite(logp - old_logp)
    mask = mask * finite.to(mask.dtype)
    old = torch.where(finite, old_logp, logp.detach())
    if behaviour_weight_cap is None:
        base, weight = old, torch.ones_like(logp)
    else:
        base = logp.detach()
        weight = torch.exp((base - old).clamp(-20.0, 20.0)).clamp(max=behaviour_weight_cap)
    log_ratio = (logp - base).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages
    per_token = -torch.minimum(unclipped, clipped) * weight * mask
    with torch.no_grad():
        n = mask.sum().clamp(min=1.0)
        was_clipped = ((unclipped - clipped).abs() > 0) & (mask > 0)
        behaviour_log_ratio = (logp - old).clamp(-20.0, 20.0)
        metrics = {
            "clip_frac": float(was_clipped.sum() / n),
            # KL(behaviour || current) estimate (k3), from the behaviour logprobs
            "approx_kl": float(
                ((behaviour_log_ratio.exp() - 1) - behaviour_log_ratio).mul(mask).sum() / n
            ),
            "ratio_mean": float(ratio.mul(mask).sum() / n),
            "ratio_max": float(ratio.masked_fill(mask == 0, 0).max()) if mask.any() else 1.0,
            "iw_mean": float(weight.mul(mask).sum() / n),
            "iw_max": float(weight.masked_fill(mask == 0, 0).max()) if mask.any() else 1.0,
        }
    return per_token, mask, metrics


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    agg: str,
    normaliser: float | None,
    seq_weight: float | None,
) -> torch.Tensor:
    """The loss from per-token terms; see the module docstring for each normaliser."""
    if agg in ("token_mean", "constant"):
        denom = normaliser if normaliser is not None else mask.sum().clamp(min=1.0)
        return per_token.sum() / denom
    if agg == "seq_mean":
        seq = per_token.sum(-1) / mask.sum(-1).clamp(min=1.0)
        return seq.sum() / (seq_weight if seq_weight is not None else max(seq.numel(), 1))
    raise ValueError(f"unknown loss aggregation {agg!r}: token_mean, seq_mean or constant")
