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
) -> tuple[torch.Tensor, dict[str, float]]:
    mask = mask.to(logp.dtype)
    log_ratio = logp - old_logp
    finite = torch.isfinite(log_ratio)
    mask = mask * finite.to(mask.dtype)
    log_ratio = torch.where(finite, log_ratio, torch.zeros_like(log_ratio)).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages
    per_token = -torch.minimum(unclipped, clipped) * mask
    if agg == "token_mean":
        denom = normaliser if normaliser is not None else mask.sum().clamp(min=1.0)
        loss = per_token.sum() / denom
    elif agg == "seq_mean":
        seq = per_token.sum(-1) / mask.sum(-1).clamp(min=1.0)
        loss = seq.sum() / (seq_weight if seq_weight is not None else max(seq.numel(), 1))
    else:
        raise ValueError(f"unknown loss aggregation {agg!r}: use token_mean or seq_mean")
    with torch.no_grad():
        n = mask.sum().clamp(min=1.0)
        was_clipped = ((unclipped - clipped).abs() > 0) & (mask > 0)
        metrics = {
            "clip_frac": float(was_clipped.sum() / n),
            "approx_kl": float(((ratio - 1) - log_ratio).mul(mask).sum() / n),
            "ratio_mean": float(ratio.mul(mask).sum() / n),
            "ratio_max": float(ratio.masked_fill(mask == 0, 0).max()) if mask.any() else 1.0,
        }
    return loss, metrics
