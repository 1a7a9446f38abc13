"""Small value types shared by the gateway, the backends and the trainer."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "cancelled"]

# Below this, logits / temperature overflow float32; the gateway treats such values as greedy.
MIN_TEMPERATURE = 1e-3
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion.

    `temperature` also defines the distribution whose log-probabilities are
    reported: logprobs are taken from softmax(logits / temperature) before any
    top-p truncation, so the trainer can recompute them exactly.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings: sampling ends once the text contains one
    top_k: int = 0  # sample from the k likeliest tokens only (0: all of them)

    def __post_init__(self) -> None:
        # Checked here, before a request joins a batch, so one bad request cannot fail others.
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError("temperature must be a finite number >= 0")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be 0 (off) or a positive count")
        if len(self.stop) > 4 or any(not s for s in self.stop):
            raise ValueError("stop takes up to 4 non-empty strings")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}]")


@dataclass(frozen=True)
class GenerateRequest:
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    # Routing hint for several replicas (the episode id): calls that share it go to the same
    # replica while that stays healthy and not much busier, so its prefix cache is reused.
    affinity: str | None = None
    # The LoRA adapter to sample with (a name the backend loaded with `load_adapter`, the
    # run id for rlgate's LoRA runs); None samples the base model's own weights.
    adapter: str | None = None


@dataclass(frozen=True)
class GenerateResult:
    """What the backend sampled, token-exact.

    `output_token_ids` include the stop token when generation ended on one
    (the model must learn to emit it); `output_logprobs[i]` is the
    log-probability of `output_token_ids[i]` under the sampling distribution;
    `policy_version` is the weight version that produced every token.
    """

    output_token_ids: list[int]
    output_logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int

    def __post_init__(self) -> None:
        if len(self.output_token_ids) != len(self.output_logprobs):
            raise ValueError("output_token_ids and output_logprobs differ in length")


def truncate_at_stop(text: str, stop: tuple[str, ...]) -> str:
    """The text before the earliest stop string (OpenAI leaves the stop string out)."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]
