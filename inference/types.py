"""Small value types shared by the gateway, the backends and the trainer."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "cancelled"]
SwapMode = Literal["keep", "drain"]
# Where each policy version began in a completion's output: (token index, version) pairs,
# the first at index 0, indexes increasing, each version newer than the one before.
VersionStarts = tuple[tuple[int, int], ...]

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
    # The version the request must start on (a pinned evaluation call served by the current
    # weights), checked where the backend admits it, at the moment it takes the version it
    # reports: admitted on another (a swap landed since the caller looked) it raises
    # `VersionMoved` and samples nothing. None starts on whatever version is served.
    version: int | None = None


@dataclass(frozen=True)
class SwapPolicy:
    """How a hot swap treats the requests generating when it starts (a run's `swap_mode`
    and `swap_clear_kv`).

    `keep`: the server pauses between two tokens, the weights change, and the
    requests in flight go on with the new version from their next token; new
    requests wait only while the weights are being replaced. Each completion
    then records where every version began (`GenerateResult.version_starts`).
    `clear_kv` True recomputes a kept request's KV cache with the new weights
    (every token after the swap is computed entirely by them); False keeps
    the KV the old weights computed (faster; PipelineRL's in-flight update; AReaL
    recomputes it, as True does).

    `drain`: new requests wait while the requests in flight finish on the
    old weights (up to the backend's drain timeout), then the weights
    change: a completion never spans two versions.
    """

    mode: SwapMode = "keep"
    clear_kv: bool = True


KEEP = SwapPolicy()
DRAIN = SwapPolicy(mode="drain")


@dataclass(frozen=True)
class GenerateResult:
    """What the backend sampled, token-exact.

    `output_token_ids` include the stop token when generation ended on one
    (the model must learn to emit it); `output_logprobs[i]` is the
    log-probability of `output_token_ids[i]` under the sampling distribution
    of the version that sampled it.

    `policy_version` is the oldest version among the completion's tokens (the
    one staleness counts). `version_starts` says where each version began when
    a keep-mode swap happened during the generation, e.g. `((0, 3), (57, 4))`:
    tokens 0..56 by version 3, 57 on by version 4. Empty means every token was
    sampled by `policy_version` (`spans` gives the explicit form either way).
    """

    output_token_ids: list[int]
    output_logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int
    version_starts: VersionStarts = ()

    def __post_init__(self) -> None:
        if len(self.output_token_ids) != len(self.output_logprobs):
            raise ValueError("output_token_ids and output_logprobs differ in length")
        if self.version_starts:
            check_version_starts(self.version_starts, len(self.output_token_ids))
            if self.version_starts[0][1] != self.policy_version:
                raise ValueError("policy_version must be the version of the first token")

    @property
    def spans(self) -> VersionStarts:
        """`version_starts`, or `((0, policy_version),)` when one version sampled it all."""
        return self.version_starts or ((0, self.policy_version),)


def check_version_starts(starts: VersionStarts, n_tokens: int) -> None:
    """Raise ValueError unless `starts` is well formed for an output of `n_tokens` tokens."""
    if not starts or starts[0][0] != 0:
        raise ValueError("version_starts must begin at token 0")
    for (i, v), (j, w) in itertools.pairwise(starts):
        if not (i < j and v < w):
            raise ValueError("version_starts must increase in index and in version")
    if starts[-1][0] > max(n_tokens - 1, 0):
        raise ValueError("a version in version_starts begins after the last token")


def result_with_marks(
    ids: list[int], logprobs: list[float], finish: FinishReason, marks: list[tuple[int, int]]
) -> GenerateResult:
    """A result from the (token index, version) marks taken while it generated: the first
    mark is the version it was admitted on, one more per keep-mode swap it lived through.

    A mark at the same index as the next one (nothing sampled between two swaps) or at or
    past the end (nothing sampled after the swap) is dropped; `policy_version` is then the
    first remaining version, and `version_starts` is empty when one version is left.
    """
    kept: list[tuple[int, int]] = []
    for index, version in marks:
        if kept and index >= len(ids):
            break
        if kept and kept[-1][0] == index:
            kept[-1] = (index, version)
        elif not kept or kept[-1][1] != version:
            kept.append((index, version))
    starts = tuple(kept) if len(kept) > 1 else ()
    return GenerateResult(ids, logprobs, finish, kept[0][1], starts)


def truncate_at_stop(text: str, stop: tuple[str, ...]) -> str:
    """The text before the earliest stop string (OpenAI leaves the stop string out)."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]
