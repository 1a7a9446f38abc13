"""Anthropic's Messages API on the wire: the streamed events and the message object.

The stream is `message_start`, `ping`, then per content block
`content_block_start`, its deltas (`thinking_delta` then `signature_delta`,
`text_delta`, `input_json_delta`) and `content_block_stop`, then
`message_delta` (stop reason, usage) and `message_stop`. A thinking block is
signed with the message id. A backend failure mid-stream is an `error` event.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from core.store.models import Completion
from gateway.agent.events import ReasoningDelta, StreamEncoder, TextDelta, ToolCallDelta
from gateway.errors import APIError
from gateway.protocol_messages import MessageResponse, MessagesRequest, MessageUsage

if TYPE_CHECKING:
    from gateway.agent.completions import Prepared

logger = logging.getLogger(__name__)

Event = dict[str, Any]


class MessageEvents(StreamEncoder[Event]):
    """The events of one streamed message, as JSON-ready dicts."""

    def __init__(self, req: MessagesRequest, prep: Prepared, message_id: str) -> None:
        self.req = req
        self.prep = prep
        self.id = message_id
        self.index = -1  # the open block's index
        self.open_kind: str | None = None  # the open block's type

    def start(self) -> list[Event]:
        usage = {"input_tokens": len(self.prep.prompt_ids), "output_tokens": 0}
        message: Event = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.req.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
            # --- rlgate extensions
            "completion_id": self.id,
            "episode_id": self.prep.placement.episode_id,
            "policy_version": self.prep.serving.backend.version,
        }
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def text(self, delta: TextDelta) -> list[Event]:
        return self.text_block("text", "text_delta", "text", delta.text)

    def reasoning(self, delta: ReasoningDelta) -> list[Event]:
        return self.text_block("thinking", "thinking_delta", "thinking", delta.text)

    def tool_call(self, delta: ToolCallDelta) -> list[Event]:
        fn = delta.call["function"]
        block = {"type": "tool_use", "id": delta.call["id"], "name": fn["name"], "input": {}}
        args = json.dumps(tool_input(fn["arguments"]), ensure_ascii=False)
        return [
            *self.open("tool_use", block),
            self.delta("input_json_delta", partial_json=args),
            *self.close(),
        ]

    def error(self, error: APIError) -> list[Event]:
        logger.warning("message stream %s failed: %s", self.id, error.message)
        return [failure(error)]

    def done(self, row: Completion) -> list[Event]:
        events = []
        if self.index < 0:  # nothing was said: one empty text block, as Anthropic sends
            events += self.open("text", {"type": "text", "text": ""})
        events += self.close()
        stop_reason, stop_sequence = stop_of(self.prep, row)
        message_delta = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"output_tokens": len(row.output_token_ids)},
            # --- rlgate extensions: the oldest version among its tokens, and where each
            # version began when a keep-mode swap happened while it was sampled (else null)
            "policy_version": row.policy_version,
            "version_starts": row.version_starts,
        }
        return [*events, message_delta, {"type": "message_stop"}]

    def text_block(self, kind: str, delta: str, field: str, text: str) -> list[Event]:
        """Text of a `kind` block: opens one unless that kind is open, then its delta."""
        if not text:
            return []
        events = [] if self.open_kind == kind else self.open(kind, {"type": kind, field: ""})
        return [*events, self.delta(delta, **{field: text})]

    def open(self, kind: str, block: Event) -> list[Event]:
        events = self.close()
        self.index += 1
        self.open_kind = kind
        events.append({"type": "content_block_start", "index": self.index, "content_block": block})
        return events

    def close(self) -> list[Event]:
        if self.open_kind is None:
            return []
        events = []
        if self.open_kind == "thinking":
            events.append(self.delta("signature_delta", signature=self.id))
        events.append({"type": "content_block_stop", "index": self.index})
        self.open_kind = None
        return events

    def delta(self, kind: str, **fields: Any) -> Event:
        return {
            "type": "content_block_delta",
            "index": self.index,
            "delta": {"type": kind, **fields},
        }


def failure(error: APIError) -> Event:
    """An error after the first event, as Anthropic words it."""
    return {"type": "error", "error": error.anthropic_body()["error"]}


def stop_of(prep: Prepared, row: Completion) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a stored completion."""
    if row.tool_calls:
        return "tool_use", None
    if row.finish_reason == "length":
        return "max_tokens", None
    text = prep.serving.template.decode(list(row.output_token_ids))
    hits = [(text.find(s), s) for s in prep.params.stop if s in text]
    if hits:
        return "stop_sequence", min(hits)[1]
    return "end_turn", None


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's `input` is (the parser made them JSON)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(row: Completion) -> list[dict[str, Any]]:
    """The answer's blocks: thinking (signed with the message id), text, tool uses."""
    blocks: list[dict[str, Any]] = []
    if row.reasoning_content is not None:
        blocks.append({"type": "thinking", "thinking": row.reasoning_content, "signature": row.id})
    if row.content or not row.tool_calls:
        blocks.append({"type": "text", "text": row.content or ""})
    for call in row.tool_calls or []:
        fn = call["function"]
        blocks.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": fn["name"],
                "input": tool_input(fn["arguments"]),
            }
        )
    return blocks


def message_response(req: MessagesRequest, prep: Prepared, row: Completion) -> MessageResponse:
    stop_reason, stop_sequence = stop_of(prep, row)
    return MessageResponse(
        id=row.id,
        content=content_blocks(row),
        model=req.model,
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage=MessageUsage(
            input_tokens=len(row.prompt_token_ids), output_tokens=len(row.output_token_ids)
        ),
        completion_id=row.id,
        episode_id=row.episode_id,
        policy_version=row.policy_version,
        version_starts=row.version_starts,
    )
