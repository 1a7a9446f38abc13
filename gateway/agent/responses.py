"""The Responses API as a translation onto chat completions, so capture stays in one place.

A request becomes a `ChatCompletionRequest`: `instructions` is a leading
system message, then the stored items of `previous_response_id` (its whole
conversation), then this request's input items. Messages map to messages; a
`function_call` item becomes (or joins) an assistant message's `tool_calls`;
a `function_call_output` item becomes a `role: tool` message; a `reasoning`
item is accepted and left out (the answer it came with is rendered from the
text rlgate sampled, thinking included). The chat service renders, samples
and stores the completion exactly as for a chat call, so placement, prefix
matching and splicing work unchanged: a follow-up that repeats the same
instructions continues the first response's episode token-exactly. As in
OpenAI's API, `instructions` are not carried over by `previous_response_id`.

Streaming encodes the sampling core's events (`gateway.agent.events`) as
Responses events (`gateway.agent.encoders.responses`); the completion is
stored before `response.completed` is sent. A run that parses reasoning
answers a `reasoning` item (`OutputReasoning`) before its message, streamed
as `response.reasoning_text.delta` events, and counts its thinking in
`usage.output_tokens_details.reasoning_tokens`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from core.store.models import Run
from core.store.responses import StoredResponse
from gateway.agent.completions import (
    ChatService,
    new_chat_id,
    params_renamed,
    translated_request,
)
from gateway.agent.encoders.chat import finish_reason
from gateway.agent.encoders.responses import (
    ResponseEvents,
    final_response,
    new_id,
    output_items,
)
from gateway.agent.episodes import EpisodeRef
from gateway.agent.events import Done
from gateway.agent.sse import event_stream, sse_events
from gateway.agent.streaming import SampleStream
from gateway.errors import InvalidRequest, NotFound
from gateway.protocol import ChatCompletionRequest
from gateway.protocol_responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    ResponsesRequest,
    ResponsesResponse,
    parse_item,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Conversation:
    """A request made ready for the chat service: all its items and the chat request."""

    items: list[dict[str, Any]]  # history + this request's input, as Responses items
    chat: ChatCompletionRequest


class ResponsesService:
    def __init__(self, chat: ChatService, sessions: async_sessionmaker[AsyncSession]) -> None:
        self.chat = chat
        self.sessions = sessions

    async def create(self, run: Run, req: ResponsesRequest, ref: EpisodeRef) -> ResponsesResponse:
        conv = await self.conversation(run, req)
        with params_renamed(ResponsesRequest.RENAMED_CHAT_FIELDS):
            prep = await self.chat.prepare(run, conv.chat, ref)
            rows, _ = await self.chat.sample(prep, new_chat_id())
        row = rows[0]
        incomplete = finish_reason(row) == "length"
        output = output_items(row, incomplete)
        resp = final_response(req, new_id("resp_"), prep, row, output, incomplete)
        await self.save(run, req, resp, conv.items)
        return resp

    async def start_stream(
        self, run: Run, req: ResponsesRequest, ref: EpisodeRef
    ) -> StreamingResponse:
        """Every client error, and a backend full or down, is raised before the first event."""
        conv = await self.conversation(run, req)
        with params_renamed(ResponsesRequest.RENAMED_CHAT_FIELDS):
            prep = await self.chat.prepare(run, conv.chat, ref)
        stream = SampleStream(self.chat, prep, new_chat_id())
        await stream.open()
        events = self.stream_events(run, req, conv, stream, ResponseEvents(req, prep, stream.id))
        return event_stream(sse_events(events), stream.episode_id)

    async def stream_events(
        self,
        run: Run,
        req: ResponsesRequest,
        conv: Conversation,
        stream: SampleStream,
        encoder: ResponseEvents,
    ) -> AsyncIterator[dict[str, Any]]:
        """The encoded events; the finished response is stored before its last event."""
        async with aclosing(stream.events()) as events:
            for out in encoder.start():
                yield out
            async for event in events:
                encoded = encoder.feed(event)
                if isinstance(event, Done) and encoder.response is not None:
                    await self.save(run, req, encoder.response, conv.items)
                for out in encoded:
                    yield out

    async def retrieve(self, run: Run, response_id: str) -> dict[str, Any]:
        return (await self.stored(run, response_id, "response_id")).response

    async def stored(self, run: Run, response_id: str, param: str) -> StoredResponse:
        async with self.sessions() as s:
            row = await s.get(StoredResponse, response_id)
        if row is None or row.run_id != _key_run(run):
            raise NotFound(
                f"no stored response {response_id!r} in this run", param=param, code="not_found"
            )
        return row

    async def conversation(self, run: Run, req: ResponsesRequest) -> Conversation:
        check_supported(req)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            prev = await self.stored(run, req.previous_response_id, "previous_response_id")
            history = list(prev.items)
        raw = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
        items: list[InputItem] = [parse_item(x) for x in history]
        for i, x in enumerate(raw):
            try:
                items.append(parse_item(x))
            except (ValueError, ValidationError) as exc:
                raise InvalidRequest(
                    f"input[{i}]: {_first_error(exc)}", param=f"input[{i}]"
                ) from exc
        messages = to_messages(items)
        if req.instructions:
            messages.insert(0, {"role": "system", "content": req.instructions})
        body: dict[str, Any] = {
            "model": req.model,
            "messages": messages,
            "max_completion_tokens": req.max_output_tokens,
            "metadata": req.metadata,
            "seed": req.seed,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "user": req.user,
            # Passed on as chat fields, so that the chat service's tool support serves them.
            "tools": chat_tools(req.tools) if req.tools else None,
            "tool_choice": chat_tool_choice(req.tool_choice),
            "parallel_tool_calls": req.parallel_tool_calls,
        }
        chat = translated_request(
            body, ResponsesRequest.RENAMED_CHAT_FIELDS, {"input": "at least one item is needed"}
        )
        stored = [*history, *(item.model_dump(exclude_none=True) for item in items[len(history) :])]
        return Conversation(stored, chat)

    async def save(
        self, run: Run, req: ResponsesRequest, resp: ResponsesResponse, items: list[dict[str, Any]]
    ) -> None:
        """Keep the response and its whole conversation, unless the caller said `store: false`."""
        if req.store is False:
            return
        output = [item.model_dump() for item in resp.output]
        async with self.sessions.begin() as s:
            s.add(
                StoredResponse(
                    id=resp.id,
                    run_id=_key_run(run),
                    completion_id=resp.completion_id or "",
                    previous_response_id=req.previous_response_id,
                    items=[*items, *output],
                    response=resp.model_dump(mode="json"),
                )
            )


def _key_run(run: Run) -> str:
    """The run whose keys reach `run`: a stored response belongs to it, so a policy's
    response can be retrieved, or continued by another policy (docs/policies.md)."""
    return run.parent_id or run.id


# --- translation -------------------------------------------------------------


def check_supported(req: ResponsesRequest) -> None:
    if req.background:
        raise InvalidRequest("background responses are not supported", param="background")
    if req.conversation is not None:
        raise InvalidRequest(
            "conversations are not supported; chain responses with previous_response_id",
            param="conversation",
        )
    fmt = (req.text or {}).get("format") or {"type": "text"}
    if fmt.get("type") != "text":
        raise InvalidRequest(
            f"text.format {fmt.get('type')!r} is not supported; only plain text",
            param="text.format",
        )


def to_messages(items: list[InputItem]) -> list[dict[str, Any]]:
    """Responses items as chat messages (see the module docstring)."""
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if out and out[-1]["role"] == "assistant":  # text and calls of one turn
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return out


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses function tools (flat) as chat tools (nested under `function`)."""
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise InvalidRequest(
                f"tool type {tool.get('type')!r} is not supported; only function tools",
                param=f"tools[{i}].type",
            )
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise InvalidRequest("a function tool needs a name", param=f"tools[{i}].name")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequest(
        "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
        param="tool_choice",
    )


def _first_error(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()))
        return f"{where}: {err.get('msg')}" if where else str(err.get("msg"))
    return str(exc)
