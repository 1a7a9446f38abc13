"""Request and response models mirroring OpenAI's names and field order.

rlgate's own extensions sit in fenced blocks marked `# --- rlgate extensions`.
Unknown request fields are accepted (extra="allow") and logged by the router.
"""

from __future__ import annotations

import math
import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    computed_field,
    field_validator,
    model_validator,
)

from gateway.request_caps import CAPS, check_parts, check_stop
from inference import registry
from trainer.config import POLICY_NAME


def finite_or_none(v: float | None) -> float | None:
    """A field validator for sampling knobs: Python's JSON parser lets NaN and Infinity in."""
    if v is not None and not math.isfinite(v):
        raise ValueError("must be a finite number")
    return v


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")

    def unknown_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    _parts = field_validator("content")(check_parts)

    def normalized(self) -> dict[str, Any]:
        """The message as stored and hashed: role, text, and tool fields when present."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [normalized_tool_call(c) for c in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.name:
            out["name"] = self.name
        return out

    def text(self) -> str:
        """Content as plain text; a list of parts keeps its text parts only."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        out = []
        for part in self.content:
            if part.get("type") not in ("text", "input_text", "output_text"):
                raise ValueError(f"content part type {part.get('type')!r} is not supported")
            out.append(str(part.get("text", "")))
        return "".join(out)


def normalized_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """Only the fields that identify a call; SDKs echo extra ones (index, None values)."""
    fn = call.get("function") or {}
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError("a tool call needs function.name")
    return {
        "id": str(call.get("id", "")),
        "type": "function",
        "function": {"name": fn["name"], "arguments": str(fn.get("arguments") or "{}")},
    }


class FunctionDef(OpenAIModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(OpenAIModel):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(OpenAIModel):
    include_usage: bool | None = None


class ChatCompletionRequest(OpenAIModel):
    messages: list[ChatMessage] = Field(min_length=1, max_length=CAPS.messages)
    model: str
    frequency_penalty: float | None = None
    # Accepted for OpenAI's clients and not applied by the samplers; capped all the same.
    logit_bias: dict[str, float] | None = Field(None, max_length=CAPS.logit_bias)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=1, le=CAPS.token_count)
    max_tokens: int | None = Field(None, ge=1, le=CAPS.token_count)
    metadata: dict[str, str] | None = None
    n: int | None = Field(1, ge=1, le=CAPS.n)
    presence_penalty: float | None = None
    response_format: dict[str, Any] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    tools: list[ToolDef] | None = Field(None, max_length=CAPS.tools)
    top_p: float | None = Field(None, gt=0, le=1)
    parallel_tool_calls: bool | None = None
    user: str | None = None
    # --- rlgate extension (vLLM's too): sample from the k likeliest tokens only
    top_k: int | None = Field(None, ge=-1, le=CAPS.token_count)  # -1 or 0: off

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        if isinstance(self.tool_choice, dict):
            name = (self.tool_choice.get("function") or {}).get("name")
            if name not in {t.function.name for t in self.tools or []}:
                raise ValueError(f"tool_choice names {name!r}, which is not in tools")
        if self.tool_choice in ("required",) and not self.tools:
            raise ValueError("tool_choice 'required' needs tools")
        return self

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def tools_active(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    _finite = field_validator("temperature", "top_p", "frequency_penalty", "presence_penalty")(
        finite_or_none
    )
    _stop = field_validator("stop")(check_stop)

    def max_new_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    # --- rlgate extension (as vLLM names it): the <think> part, when a run parses reasoning
    reasoning_content: str | None = None


class Choice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls", "content_filter"]
    # --- rlgate extensions
    # The id to reward this choice by, and the episode it was filed under (with n > 1
    # every choice is an episode of its own, all in the response's group).
    completion_id: str | None = None
    episode_id: str | None = None
    # Where each version began in this choice's tokens (null: one version), as the response's.
    version_starts: list[list[int]] | None = None


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails | None = None  # set when a run thinks


class SampledCompletion(BaseModel):
    """What an OpenAI chat or text completion object says of where it came from, with
    rlgate's record of the episode and the policy version that sampled it."""

    id: str
    object: str  # each kind's literal
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Any]  # each kind's choices
    usage: Usage | None = None
    system_fingerprint: str | None = None
    # --- rlgate extensions
    # The episode (n = 1) or group (n > 1) this call was filed under, and the policy
    # version that sampled it (the oldest among its tokens; of the first choice).
    episode_id: str | None = None
    policy_version: int | None = None
    # Where each version began, [[token index, version], ...], when a keep-mode hot swap
    # happened while the first choice was sampled; null: all by `policy_version`.
    version_starts: list[list[int]] | None = None


class ChatCompletion(SampledCompletion):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[Choice]
    usage: Usage
    group_id: str | None = None  # rlgate: the group a call with n > 1 was filed under


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "rlgate"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --- rlgate's own API (not OpenAI's) -----------------------------------------


class RewardRequest(BaseModel):
    """A reward for one completion or one whole episode."""

    model_config = ConfigDict(extra="forbid")

    reward: float
    completion_id: str | None = Field(None, max_length=64)
    episode_id: str | None = Field(None, max_length=100)
    # With episode_id, on a run with policies: only that policy's turns (docs/policies.md).
    policy: str | None = Field(None, pattern=POLICY_NAME)
    idempotency_key: str | None = Field(None, min_length=1, max_length=200)

    @field_validator("reward")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("reward must be a finite number")
        return v

    @field_validator("completion_id", "episode_id", "idempotency_key")
    @classmethod
    def _printable(cls, v: str | None) -> str | None:
        if v is not None and any(ord(ch) < 32 or ord(ch) == 127 for ch in v):
            raise ValueError("may not contain control characters")
        return v

    @model_validator(mode="after")
    def _one_target(self) -> RewardRequest:
        # Neither is allowed here: under /episodes/{id}/v1 the path names the episode.
        if self.completion_id is not None and self.episode_id is not None:
            raise ValueError("give one of completion_id or episode_id, not both")
        if self.policy is not None and self.completion_id is not None:
            raise ValueError("policy goes with episode_id: a completion's reward is its policy's")
        return self


class NextStep(BaseModel):
    """What the run's next train step waits for."""

    step: int  # its number: it trains version `step` into `step + 1`
    ready_groups: int  # groups that could train now
    groups_per_step: int  # groups it takes; it starts once ready_groups reaches this
    in_flight: bool  # a step is queued or running (the next one is claimed after it)


class AdmissionState(BaseModel):
    """The run's admission capacity (docs/rewards.md, "Keeping up with the trainer")."""

    capacity: int  # unconsumed episodes the run admits before new conversations are held
    in_use: int  # open, rewarded and queued episodes (plus admitted ones not stored yet)
    group_capacity: int | None  # the same in groups (None: max_pending_episodes overrides)
    groups_in_use: int  # unconsumed groups (a group of more than group_size counts more)
    held: int  # new conversations this gateway process is holding now


class SampleState(BaseModel):
    """What happened to an episode or a group.

    state: open (waiting for its reward), waiting (its group is incomplete),
    ready (waits for a step), queued or trained (at `step`), stale,
    skipped_zero_variance or dropped_incomplete (never trains), expired, eval (held out:
    scored, never trained).
    """

    id: str
    state: str
    step: int | None = None  # queued or trained at this step
    episodes: int = 1  # members counted (a group)


class RunProgress(BaseModel):
    """GET /v1/runs/self, and `progress` in a reward acknowledgement."""

    object: Literal["run.progress"] = "run.progress"
    run_id: str
    status: str  # active, paused, stopped, failed
    version: int  # the newest policy version
    next_step: NextStep
    admission: AdmissionState
    episode: SampleState | None = None  # the episode asked about
    group: SampleState | None = None  # its group (or the group asked about)


class RewardAck(BaseModel):
    object: Literal["reward"] = "reward"
    id: int
    run_id: str
    completion_id: str | None
    episode_id: str
    reward: float
    episode_status: str
    duplicate: bool = False
    policy: str | None = None  # a policy-scoped reward's policy (docs/policies.md)
    # --- rlgate: where the episode and its group stand after this reward
    progress: RunProgress | None = None


def _backend_kinds(schema: dict[str, JsonValue]) -> None:
    """The schema's `enum` of backend kinds, read when the schema is built, not at import."""
    kinds: list[JsonValue] = [*registry.names()]
    schema["enum"] = kinds


class RunCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=200)
    model: str = Field(min_length=1, max_length=500, description="alias (tiny, smollm2) or path")
    backend: str = Field(
        "local",
        description="a backend kind of inference.registry (local, vllm, sglang, ...)",
        json_schema_extra=_backend_kinds,
    )
    config: dict[str, Any] = Field(default_factory=dict, description="trainer.config.RunConfig")
    # remote backends: base URLs of servers already serving `model` (more: POST .../replicas)
    replicas: list[str] = Field(default_factory=list, max_length=64)

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        registry.get(v)  # UnknownBackend (a ValueError) names the known kinds
        return v


class ReplicaCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(min_length=8, max_length=500, description="server base URL, without /v1")


class ReplicaPublic(BaseModel):
    """One inference server of a run; live fields are null while the run is not loaded."""

    url: str
    healthy: bool | None = None
    loading: bool | None = None
    version: int | None = None  # the policy version this server serves now
    outstanding: int | None = None  # requests it is generating now
    served: int | None = None
    last_error: str | None = None


class RunPublic(BaseModel):
    run_id: str
    name: str
    model: str
    backend: str
    status: str
    base_url: str
    current_version: int
    served_version: int | None
    replicas: list[ReplicaPublic] = []  # vllm/sglang: each server's version, health, load
    config: dict[str, Any]
    counters: dict[str, Any]
    # How calls found their episode (path, header, metadata, prefix, new) and how many
    # turns drifted from the template (each starts a new training sequence).
    calls_by_link: dict[str, int] = {}
    template_drift: int = 0
    created_at: str
    # A policy's run (docs/policies.md): the run that declared it, and its name there.
    parent_id: str | None = None
    policy: str | None = None


class RunCreated(RunPublic):
    api_key: str


class TrainStepPublic(BaseModel):
    """One train step as the admin API shows it; read straight from its store row."""

    model_config = ConfigDict(from_attributes=True)

    step: int
    status: str
    n_episodes: int
    n_groups: int
    loss: float | None
    reward_mean: float | None
    reward_std: float | None
    tokens: int | None
    duration_s: float | None
    metrics: dict[str, Any]
    error: str | None

    @field_validator("metrics", mode="before")
    @classmethod
    def _no_metrics_yet(cls, v: Any) -> Any:
        return {} if v is None else v  # a step that has not finished has none

    @computed_field(return_type=int)  # wraps the method in a property
    def version(self) -> int:
        """The policy version this step produces."""
        return self.step + 1


class ApiKeyPublic(BaseModel):
    id: int
    run_id: str
    prefix: str  # the first characters, to tell keys apart; the key itself is never stored
    created_at: str
    revoked_at: str | None


class ApiKeyCreated(ApiKeyPublic):
    api_key: str  # shown once


class RunStatusChange(BaseModel):
    run_id: str
    status: str
