"""The one policy loss every algorithm is a configuration of.

    loss = aggregate( PPO-clip(ratio, A) * w_behaviour       (ppo.py; w = 1 unless decoupled)
                      + kl_coef * KL_k(pi || ref)             (kl.py; only if kl_coef > 0)
                      - entropy_coef * H(pi) )                (only if entropy_coef > 0)

GRPO, Dr.GRPO and RLOO differ in the advantages (trainer.advantages) and in
`loss_agg`; DAPO raises `clip_eps_high`; decoupled PPO sets
`behaviour_weight_cap`. RunConfig rejects combinations that do not fit.
"""

from __future__ import annotations

import torch

from trainer.config import RunConfig
from trainer.losses.kl import kl_penalty
from trainer.losses.ppo import aggregate, ppo_per_token


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: RunConfig,
    *,
    n_tokens: float,
    n_sequences: float,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """[B, T] inputs; `n_tokens`/`n_sequences` count the WHOLE batch (all micro-batches)."""
    per_token, mask, metrics = ppo_per_token(
        logp,
        old_logp,
        advantages,
        mask,
        cfg.clip_eps_low,
        cfg.clip_eps_high,
        cfg.behaviour_weight_cap,
    )
    n = mask.sum().clamp(min=1.0)
    if cfg.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs the reference model's logprobs")
        kl = kl_penalty(logp, ref_logp, cfg.kl_estimator) * mask
        per_token = per_token + cfg.kl_coef * kl
        metrics["kl_ref"] = float(kl.detach().sum() / n)
    if entropy is not None:
        if cfg.entropy_coef > 0:
            per_token = per_token - cfg.entropy_coef * entropy * mask
        metrics["entropy"] = float((entropy.detach() * mask).sum() / n)
    if cfg.loss_agg == "constant":
        normaliser = float(n_sequences * (cfg.constant_normaliser or 1))
    else:
        normaliser = float(max(n_tokens, 1))
    loss = aggregate(per_token, mask, cfg.loss_agg, normaliser, float(n_sequences))
    return loss, metrics
