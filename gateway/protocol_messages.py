"""Models for Anthropic's Messages API (`POST /v1/messages`), the subset rlgate serves.

Names and field order mirror Anthropic's; rlgate's extensions sit in fenced
blocks marked `# --- rlgate extensions`. Unknown request fields are accepted
(extra="allow") and logged by the router. Content blocks stay plain dicts
here: `gateway.agent.messages` reads them one by one, so that an error
names the block (`messages[1].content[0]`) plainly.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, field_validator

from gateway.protocol import OpenAIModel, finite_or_none
from gateway.request_caps import CAPS, check_parts, check_stop

# --- request -----------------------------------------------------------------


class MessageParam(OpenAIModel):
    # "system" mid-conversation: Claude Code sends one (its environment) after the user turn.
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]

    _parts = field_validator("content")(check_parts)


class ToolParam(OpenAIModel):
    """A client tool. Anthropic's server tools (`type: web_search_...`) are refused."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class ToolChoice(OpenAIModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(OpenAIModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1, le=CAPS.token_count)


class CountTokensRequest(OpenAIModel):
    """`POST /v1/messages/count_tokens`: what a prompt costs before it is sent."""

    model: str
    messages: list[MessageParam] = Field(min_length=1, max_length=CAPS.messages)
    system: str | list[dict[str, Any]] | None = None
    tools: list[ToolParam] | None = Field(None, max_length=CAPS.tools)
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    _parts = field_validator("system")(check_parts)


class MessagesRequest(CountTokensRequest):
    # Chat request fields this request names otherwise (chat name: ours); the chat service's
    # errors about them name ours (`gateway.agent.completions.params_renamed`).
    RENAMED_CHAT_FIELDS: ClassVar[dict[str, str]] = {
        "max_completion_tokens": "max_tokens",
        "stop": "stop_sequences",
    }

    max_tokens: int = Field(ge=1, le=CAPS.token_count)
    metadata: dict[str, str | None] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0, le=CAPS.token_count)
    top_p: float | None = Field(None, gt=0, le=1)
    # --- rlgate extensions
    # Seeds the sampler, as `seed` does on chat completions (Anthropic's API has none).
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)

    _finite = field_validator("temperature", "top_p")(finite_or_none)
    _stop = field_validator("stop_sequences")(check_stop)


# --- response ----------------------------------------------------------------


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[dict[str, Any]]
    model: str
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: MessageUsage
    # --- rlgate extensions
    # The id to reward this message by (the message's own id), the episode it was filed
    # under and the policy version that sampled it.
    completion_id: str | None = None
    episode_id: str | None = None
    policy_version: int | None = None
    # Where each version began, [[token index, version], ...], when a keep-mode hot swap
    # happened while it was sampled; null: every token by `policy_version` (the oldest).
    version_starts: list[list[int]] | None = None


class TokenCount(BaseModel):
    input_tokens: int
