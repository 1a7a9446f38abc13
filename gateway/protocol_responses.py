"""Models for OpenAI's Responses API (`POST /v1/responses`), the subset rlgate serves.

Names and field order mirror OpenAI's; rlgate's extensions sit in fenced
blocks marked `# --- rlgate extensions`. Unknown request fields are accepted
(extra="allow") and logged by the router. Input items are parsed one by one
(`parse_item`) so that an error names the item (`input[2]`) plainly.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, field_validator

from gateway.protocol import OpenAIModel, finite_or_none
from gateway.request_caps import CAPS, check_parts

# --- request -----------------------------------------------------------------


class ResponsesRequest(OpenAIModel):
    # Chat request fields this request names otherwise (chat name: ours); the chat service's
    # errors about them name ours (`gateway.agent.completions.params_renamed`).
    RENAMED_CHAT_FIELDS: ClassVar[dict[str, str]] = {
        "messages": "input",
        "max_completion_tokens": "max_output_tokens",
    }

    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    include: list[str] | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=CAPS.token_count)
    metadata: dict[str, str] | None = None
    model: str
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = Field(None, min_length=1, max_length=64)
    reasoning: dict[str, Any] | None = None
    store: bool | None = True
    stream: bool | None = False
    temperature: float | None = Field(None, ge=0, le=2)
    text: dict[str, Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=CAPS.tools)
    top_p: float | None = Field(None, gt=0, le=1)
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    # --- rlgate extensions
    # Seeds the sampler, as `seed` does on chat completions (OpenAI's Responses API has none).
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)

    _finite = field_validator("temperature", "top_p")(finite_or_none)

    @field_validator("input")
    @classmethod
    def _few_items(cls, v: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        if isinstance(v, list) and len(v) > CAPS.messages:
            raise ValueError(f"at most {CAPS.messages} input items are allowed")
        return v


class MessageItem(OpenAIModel):
    """A message in `input`; `{"role", "content"}` without a `type` is one too."""

    type: Literal["message"] = "message"
    id: str | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]
    status: str | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, v: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        return _text_parts(v)

    def text(self) -> str:
        return _joined(self.content)


class FunctionCallItem(OpenAIModel):
    """A function call the model made (it came back from an earlier response)."""

    type: Literal["function_call"] = "function_call"
    id: str | None = None
    call_id: str
    name: str
    arguments: str
    status: str | None = None


class FunctionCallOutputItem(OpenAIModel):
    """What the agent's function returned for `call_id`."""

    type: Literal["function_call_output"] = "function_call_output"
    id: str | None = None
    call_id: str
    output: str | list[dict[str, Any]]
    status: str | None = None

    @field_validator("output")
    @classmethod
    def _text_only(cls, v: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        return _text_parts(v)

    def text(self) -> str:
        return _joined(self.output)


class ReasoningItem(OpenAIModel):
    """An earlier response's reasoning, echoed back (the Agents SDK does so every turn).

    Accepted and not rendered: an answer rlgate sampled is rendered from its
    sampled text, thinking included, whatever the client sends with it.
    """

    type: Literal["reasoning"] = "reasoning"
    id: str | None = None
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


TEXT_PARTS = ("input_text", "output_text", "text")


def _text_parts(value: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Only text parts can be rendered into a prompt; images and files are refused."""
    check_parts(value)
    if isinstance(value, list):
        for part in value:
            if part.get("type") not in TEXT_PARTS:
                raise ValueError(f"content part type {part.get('type')!r} is not supported")
            if not isinstance(part.get("text", ""), str):
                raise ValueError("a text part's text must be a string")
    return value


def _joined(value: str | list[dict[str, Any]]) -> str:
    if isinstance(value, str):
        return value
    return "".join(part.get("text", "") for part in value)


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem

ITEM_TYPES: dict[str, type[InputItem]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


def parse_item(raw: dict[str, Any]) -> InputItem:
    """One input item by its `type` (a bare `{"role", "content"}` is a message).

    Raises ValueError for an unsupported type, pydantic's ValidationError for a bad shape.
    """
    kind = raw.get("type", "message")
    model = ITEM_TYPES.get(kind)
    if model is None:
        raise ValueError(
            f"input item type {kind!r} is not supported; use one of {', '.join(ITEM_TYPES)}"
        )
    return model.model_validate(raw)


# --- response ----------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    """A run's `<think>` text, as the openai SDK's `ResponseReasoningItem` parses it.

    The thinking is the model's own text, not a summary of it, so it is one
    `reasoning_text` part in `content` and `summary` is empty (as vLLM serves
    open models' reasoning); streamed as `response.reasoning_text.delta` and
    `.done` events.
    """

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[dict[str, Any]] = []
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputReasoning | OutputMessage | OutputFunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponsesResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = []
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    temperature: float = 1.0
    text: dict[str, Any] = {"format": {"type": "text"}}
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = []
    top_p: float = 1.0
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = {}
    # --- rlgate extensions
    # The episode this response was filed under, the policy version that sampled it, and
    # the completion id that holds its tokens (reward by it, or by the episode).
    episode_id: str | None = None
    policy_version: int | None = None
    # Where each version began, [[token index, version], ...], when a keep-mode hot swap
    # happened while it was sampled; null: every token by `policy_version` (the oldest).
    version_starts: list[list[int]] | None = None
    completion_id: str | None = None

    def output_text(self) -> str:
        return "".join(
            part.text
            for item in self.output
            if isinstance(item, OutputMessage)
            for part in item.content
        )
