"""Anthropic's Messages API as a translation onto chat completions, so capture stays in one place.

A request becomes a `ChatCompletionRequest`:

* `system` (a string or text blocks) is a leading system message, and a
  `role: system` turn (Claude Code sends one mid-conversation) a system message;
* a user turn's text blocks are one user message, and each `tool_result`
  block a `role: tool` message (before the text, as Anthropic orders them);
* an assistant turn's text blocks are its content and its `tool_use` blocks
  its `tool_calls`; `thinking` blocks are dropped: an answer rlgate sampled is
  rendered from the ids it sampled, thinking included (`with_sampled_answers`);
* `tools`, `tool_choice`, `stop_sequences`, `max_tokens`, `temperature`,
  `top_p`, `top_k` and `metadata` map to their chat twins; `thinking`
  enabled splits `<think>...</think>` out as a `thinking` block even where
  the run does not parse reasoning.

The chat service renders, samples and stores the completion exactly as for a
chat call, under the message's own id (`msg_...`, the id to reward it by), so
placement, prefix matching and splicing work unchanged, and an episode may
mix Messages and chat calls. Images and documents are refused: rlgate serves
text models.

Streaming encodes the sampling core's events (`gateway.agent.events`) as
Anthropic's events (`gateway.agent.encoders.messages`). The completion is
stored before `message_delta` is sent; a failure after the first event is an
`error` event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi.responses import StreamingResponse

from core.store.models import Run
from gateway.agent.completions import (
    ChatService,
    Prepared,
    params_renamed,
    translated_request,
)
from gateway.agent.encoders.messages import MessageEvents, failure, message_response
from gateway.agent.episodes import EpisodeRef
from gateway.agent.events import encoded
from gateway.agent.sse import event_stream, sse_events
from gateway.agent.streaming import SampleStream
from gateway.errors import APIError, InvalidRequest
from gateway.protocol import ChatCompletionRequest
from gateway.protocol_messages import (
    CountTokensRequest,
    MessageResponse,
    MessagesRequest,
    TokenCount,
)
from inference.tool_prompt import with_tools

logger = logging.getLogger(__name__)

REFUSED_BLOCKS = ("image", "document", "search_result", "container_upload")


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex


class MessagesService:
    def __init__(self, chat: ChatService) -> None:
        self.chat = chat

    async def create(self, run: Run, req: MessagesRequest, ref: EpisodeRef) -> MessageResponse:
        prep = await self.prepare(run, req, ref)
        rows, _ = await self.chat.sample(prep, new_message_id())
        return message_response(req, prep, rows[0])

    async def start_stream(
        self, run: Run, req: MessagesRequest, ref: EpisodeRef
    ) -> StreamingResponse:
        """Every client error, and a backend full or down, is raised before the first event."""
        prep = await self.prepare(run, req, ref)
        stream = SampleStream(self.chat, prep, new_message_id())
        await stream.open()
        events = encoded(stream.events(), MessageEvents(req, prep, stream.id))
        return event_stream(sse_events(_ended_by_errors(events, stream.id)), stream.episode_id)

    async def count_tokens(self, run: Run, req: CountTokensRequest) -> TokenCount:
        """The prompt's tokens as a new conversation would render it (no splice, no admission)."""
        chat = chat_request(req, max_tokens=1)
        serving = await self.chat.serving(run)
        template = serving.template
        try:
            messages = [m.normalized() for m in chat.messages]
            to_render, native = with_tools(
                messages, chat.tool_dicts(), chat.tool_choice, template.native_tools
            )
            ids = await asyncio.to_thread(template.render, to_render, native)
        except Exception as exc:  # a template can raise on roles or shapes it does not know
            raise InvalidRequest(
                f"messages could not be rendered: {exc}", param="messages"
            ) from exc
        return TokenCount(input_tokens=len(ids))

    async def prepare(self, run: Run, req: MessagesRequest, ref: EpisodeRef) -> Prepared:
        chat = chat_request(req, max_tokens=req.max_tokens)
        think = req.thinking is not None and req.thinking.type != "disabled"
        with params_renamed(MessagesRequest.RENAMED_CHAT_FIELDS):
            return await self.chat.prepare(run, chat, ref, think=think)


# --- request translation -------------------------------------------------------------------


def chat_request(req: CountTokensRequest, max_tokens: int) -> ChatCompletionRequest:
    """The chat request that samples what `req` asks for."""
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _text_of(req.system, "system")})
    for i, m in enumerate(req.messages):
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        where = f"messages[{i}].content"
        if m.role == "user":
            messages.extend(_user_turn(blocks, where))
        elif m.role == "system":
            messages.append({"role": "system", "content": _text_of(blocks, where)})
        else:
            messages.append(_assistant_turn(blocks, where))
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": max_tokens,
    }
    if isinstance(req, MessagesRequest):
        body.update(
            metadata={k: v for k, v in (req.metadata or {}).items() if v is not None} or None,
            stop=req.stop_sequences or None,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=req.seed,
        )
    if req.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.input_schema,
                },
            }
            for t in req.tools
        ]
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req)
        if req.tool_choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    return translated_request(body, MessagesRequest.RENAMED_CHAT_FIELDS)


def _tool_choice(req: CountTokensRequest) -> Any:
    choice = req.tool_choice
    assert choice is not None
    if choice.type == "tool":
        names = {t.name for t in req.tools or []}
        if choice.name not in names:
            raise InvalidRequest(
                f"tool_choice names {choice.name!r}, which is not in tools",
                param="tool_choice.name",
            )
        return {"type": "function", "function": {"name": choice.name}}
    if choice.type == "any" and not req.tools:
        raise InvalidRequest("tool_choice 'any' needs tools", param="tool_choice")
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _block_type(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise InvalidRequest(f"{where}: a content block needs a 'type'", param=where)
    kind = block["type"]
    if kind in REFUSED_BLOCKS:
        raise InvalidRequest(
            f"{where}: {kind} blocks are not supported: rlgate serves text-only models",
            param=where,
            code="unsupported_content",
        )
    return kind


def _block_text(block: dict[str, Any], at: str) -> str:
    if not isinstance(block.get("text"), str):
        raise InvalidRequest(f"{at}: a text block needs a 'text' string", param=at)
    return block["text"]


def _typed_blocks(blocks: list[Any], where: str) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(where, type, block) of each block, a refused or untyped one refused here."""
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        yield at, _block_type(block, at), block


def _text_of(content: Any, where: str) -> str:
    """Text from a string or a list of text blocks (a system prompt, a tool result)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}: expected a string or a list of blocks", param=where)
    parts = []
    for at, kind, block in _typed_blocks(content, where):
        if kind != "text":
            raise InvalidRequest(f"{at}: only text blocks are allowed here, not {kind!r}", param=at)
        parts.append(_block_text(block, at))
    return "".join(parts)


def _user_turn(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    tools, text = [], []
    for at, kind, block in _typed_blocks(blocks, where):
        if kind == "text":
            text.append(_block_text(block, at))
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise InvalidRequest(f"{at}: tool_result needs tool_use_id", param=at)
            result = _text_of(block.get("content") or "", f"{at}.content")
            tools.append({"role": "tool", "tool_call_id": call_id, "content": result})
        else:
            raise InvalidRequest(f"{at}: a user turn cannot hold a {kind!r} block", param=at)
    return [*tools, *([{"role": "user", "content": "".join(text)}] if text or not tools else [])]


def _assistant_turn(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    text, calls = [], []
    for at, kind, block in _typed_blocks(blocks, where):
        if kind == "text":
            text.append(_block_text(block, at))
        elif kind == "tool_use":
            name, args = block.get("name"), block.get("input", {})
            if not isinstance(name, str) or not isinstance(args, dict):
                raise InvalidRequest(f"{at}: tool_use needs a name and an input object", param=at)
            fn = {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}
            calls.append({"id": str(block.get("id", "")), "type": "function", "function": fn})
        elif kind not in ("thinking", "redacted_thinking"):
            raise InvalidRequest(f"{at}: an assistant turn cannot hold a {kind!r} block", param=at)
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        msg["tool_calls"] = calls
    return msg


async def _ended_by_errors(
    events: AsyncIterator[dict[str, Any]], label: str
) -> AsyncIterator[dict[str, Any]]:
    """`events`, ended by Anthropic's error event when the answer could not be stored (the
    status line went out with the first event)."""
    try:
        async for event in events:
            yield event
    except APIError as exc:
        logger.warning("message stream %s ended by an error: %s", label, exc.message)
        yield failure(exc)
