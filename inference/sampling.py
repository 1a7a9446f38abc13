"""Per-row sampling from logits, returning the token and its log-probability."""

from __future__ import annotations

import torch

from inference.types import SamplingParams


def sampling_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-softmax of `logits / temperature`; greedy (temperature 0) reports temperature 1.

    This is the distribution the trainer recomputes, so it is taken before
    top-p truncation (a truncated distribution has -inf where the trainer's
    does not).
    """
    scale = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits.float() / scale, dim=-1)


def sample_row(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[int, float]:
    """Sample one token id from a [vocab] logits row; return (id, logprob)."""
    logprobs = sampling_logprobs(logits, params.temperature)
    if params.temperature <= 0:
        token = int(torch.argmax(logprobs))
        return token, float(logprobs[token])
    probs = logprobs.exp()
    if 0 < params.top_k < probs.numel():
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p
        keep[0] = True
        truncated = torch.zeros_like(probs)
        truncated[order[keep]] = sorted_probs[keep]
        probs = truncated
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(logprobs[token])
