"""KL penalty to a frozen reference policy, per token (Schulman's estimators).

With r = log pi_ref(x) - log pi(x) on a token sampled from pi:
- k1 = -r                     (unbiased, can be negative)
- k3 = exp(r) - r - 1         (unbiased for KL(pi || ref), always >= 0; GRPO's choice)
Both are [B, T]; the caller masks and aggregates them with the policy loss.
"""

from __future__ import annotations

import torch


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    r = (ref_logp - logp).clamp(-20.0, 20.0)
    if estimator == "k1":
        return -r
    if estimator == "k3":
        return torch.exp(r) - r - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}: k1 or k3")
