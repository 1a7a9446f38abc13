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

Streaming drives `ChatStream` and turns its chunks into Responses events;
the completion is stored before `response.completed` is sent. A run that
parses reasoning answers a `reasoning` item (`OutputReasoning`) before its
message, streamed as `response.reasoning_text.delta` events, and counts its
thinking in `usage.output_tokens_details.reasoning_tokens`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from core.store.models import Completion, Run
from core.store.responses import StoredResponse
from gateway.agent.completions import ChatService, chat_usage
from gateway.agent.episodes import EpisodeRef
from gateway.agent.streaming import ChatStream
from gateway.errors import APIError, InvalidRequest, NotFound
from gateway.protocol import ChatCompletionRequest, Usage
from gateway.protocol_responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    IncompleteDetails,
    InputItem,
    MessageItem,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTokensDetails,
    ReasoningText,
    ResponseError,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
    parse_item,
)
from inference.backend import BackendError

logger = logging.getLogger(__name__)

# Chat request fields that have another name in a Responses request.
CHAT_TO_RESPONSES_PARAM = {"messages": "input", "max_completion_tokens": "max_output_tokens"}


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
        with chat_params_renamed():
            completion = await self.chat.create(run, conv.chat, ref)
        choice = completion.choices[0]
        incomplete = choice.finish_reason == "length"
        resp = response_object(
            req,
            new_id("resp_"),
            output=output_items(choice.message, incomplete),
            incomplete=incomplete,
            usage=response_usage(completion.usage),
            episode_id=completion.episode_id,
            policy_version=completion.policy_version,
            completion_id=choice.completion_id or completion.id,
        )
        await self.save(run, req, resp, conv.items)
        return resp

    async def start_stream(
        self, run: Run, req: ResponsesRequest, ref: EpisodeRef
    ) -> ResponseStream:
        """Every client error is raised here, before the first event could be sent."""
        conv = await self.conversation(run, req)
        with chat_params_renamed():
            prep = await self.chat.prepare(run, conv.chat, ref)
        chat = ChatStream(self.chat, prep)
        await chat.open()
        return ResponseStream(self, req, conv, chat)

    async def retrieve(self, run: Run, response_id: str) -> dict[str, Any]:
        return (await self.stored(run, response_id, "response_id")).response

    async def stored(self, run: Run, response_id: str, param: str) -> StoredResponse:
        async with self.sessions() as s:
            row = await s.get(StoredResponse, response_id)
        if row is None or row.run_id != run.id:
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
        try:
            chat = ChatCompletionRequest.model_validate(
                {k: v for k, v in body.items() if v is not None}
            )
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = [str(p) for p in err.get("loc", ())]
            param = CHAT_TO_RESPONSES_PARAM.get(loc[0], loc[0]) if loc else None
            msg = "at least one item is needed" if param == "input" else err.get("msg")
            raise InvalidRequest(f"{param}: {msg}", param=param, code="invalid_value") from exc
        stored = [*history, *(item.model_dump(exclude_none=True) for item in items[len(history) :])]
        return Conversation(stored, chat)

    async def completion(self, completion_id: str) -> Completion | None:
        async with self.sessions() as s:
            return await s.get(Completion, completion_id)

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
                    run_id=run.id,
                    completion_id=resp.completion_id or "",
                    previous_response_id=req.previous_response_id,
                    items=[*items, *output],
                    response=resp.model_dump(mode="json"),
                )
            )


class ResponseStream:
    """One streaming response: `events()` yields Responses events as JSON-ready dicts."""

    def __init__(
        self, service: ResponsesService, req: ResponsesRequest, conv: Conversation, chat: ChatStream
    ) -> None:
        self.service = service
        self.req = req
        self.conv = conv
        self.chat = chat
        self.id = new_id("resp_")
        self.seq = 0
        self.output: list[OutputItem] = []
        self.reasoning: OutputReasoning | None = None  # the thinking being streamed
        self.message: OutputMessage | None = None  # the text item being streamed
        self.calls: dict[int, OutputFunctionCall] = {}  # tool calls being streamed, by index

    @property
    def episode_id(self) -> str:
        return self.chat.prep.placement.episode_id

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        out = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return out

    def snapshot(self, status: str, **fields: Any) -> dict[str, Any]:
        resp = response_object(
            self.req,
            self.id,
            output=list(self.output),
            episode_id=self.episode_id,
            completion_id=self.chat.id,  # known from the start: a cut stream is stored under it
            **fields,
        )
        return resp.model_copy(update={"status": status}).model_dump(mode="json")

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        yield self.event("response.created", response=self.snapshot("in_progress"))
        yield self.event("response.in_progress", response=self.snapshot("in_progress"))
        finish = None
        chunks = self.chat.chunks()
        try:
            async for chunk in chunks:
                if "error" in chunk:  # the chat stream's in-stream error: the backend broke
                    raise BackendError(chunk["error"]["message"])
                if not chunk.get("choices"):
                    continue
                choice = chunk["choices"][0]
                delta = choice.get("delta") or {}
                if delta.get("reasoning_content"):
                    for e in self.reasoning_delta(delta["reasoning_content"]):
                        yield e
                if delta.get("content"):
                    for e in self.text_delta(delta["content"]):
                        yield e
                for call in delta.get("tool_calls") or []:
                    for e in self.call_delta(call):
                        yield e
                finish = choice.get("finish_reason") or finish
        except BackendError as exc:
            logger.warning("response stream %s failed: %s", self.id, exc)
            error = ResponseError(code="server_error", message="the inference backend failed")
            yield self.event("response.failed", response=self.snapshot("failed", error=error))
            return
        finally:
            await chunks.aclose()
        incomplete = finish == "length"
        if self.message is None and not self.calls:  # no answer: a cut hit the thinking
            for e in [*self.close_items(incomplete), *self.text_delta("")]:
                yield e
        for e in self.close_items(incomplete):
            yield e
        row = await self.service.completion(self.chat.id)
        assert row is not None, "the chat stream stores its completion before it finishes"
        resp = response_object(
            self.req,
            self.id,
            output=self.output,
            incomplete=incomplete,
            usage=response_usage(chat_usage([row], self.chat.prep.serving.template.decode)),
            episode_id=row.episode_id,
            policy_version=row.policy_version,
            completion_id=row.id,
        )
        await self.service.save(self.chat.prep.run, self.req, resp, self.conv.items)
        kind = "response.incomplete" if incomplete else "response.completed"
        yield self.event(kind, response=resp.model_dump(mode="json"))

    def open_item(self, item: Any, part: Any) -> list[dict[str, Any]]:
        """Append `item` with its first, empty content `part`: the two events that announce it."""
        self.output.append(item)
        index = len(self.output) - 1
        added = self.event("response.output_item.added", output_index=index, item=_dump(item))
        item.content.append(part)
        part_added = self.event(
            "response.content_part.added",
            item_id=item.id,
            output_index=index,
            content_index=0,
            part=part.model_dump(),
        )
        return [added, part_added]

    def reasoning_delta(self, piece: str) -> list[dict[str, Any]]:
        """A chat `reasoning_content` delta: opens the reasoning item, then streams its text."""
        events = []
        if self.reasoning is None:
            self.reasoning = OutputReasoning(id=new_id("rs_"), status="in_progress", content=[])
            events += self.open_item(self.reasoning, ReasoningText(text=""))
        self.reasoning.content[0].text += piece
        events.append(
            self.event(
                "response.reasoning_text.delta",
                item_id=self.reasoning.id,
                output_index=self.output.index(self.reasoning),
                content_index=0,
                delta=piece,
            )
        )
        return events

    def text_delta(self, piece: str) -> list[dict[str, Any]]:
        events = []
        if self.message is None:
            events += self.close_reasoning()
            self.message = OutputMessage(id=new_id("msg_"), status="in_progress", content=[])
            events += self.open_item(self.message, OutputText(text=""))
        if piece:
            self.message.content[0].text += piece
            events.append(
                self.event(
                    "response.output_text.delta",
                    item_id=self.message.id,
                    output_index=self.output.index(self.message),
                    content_index=0,
                    delta=piece,
                    logprobs=[],
                )
            )
        return events

    def call_delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """A chat `tool_calls` delta: opens the call's function_call item, then streams its args."""
        events = []
        index = delta.get("index", 0)
        fn = delta.get("function") or {}
        call = self.calls.get(index)
        if call is None:
            events += self.close_reasoning()
            call = OutputFunctionCall(
                id=new_id("fc_"),
                call_id=delta.get("id") or new_id("call_"),
                name=fn.get("name") or "",
                arguments="",
                status="in_progress",
            )
            self.calls[index] = call
            self.output.append(call)
            events.append(
                self.event(
                    "response.output_item.added",
                    output_index=len(self.output) - 1,
                    item=_dump(call),
                )
            )
        pieces = fn.get("arguments")
        if pieces:
            pieces = pieces if isinstance(pieces, str) else json.dumps(pieces)
            call.arguments += pieces
            events.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=call.id,
                    output_index=self.output.index(call),
                    delta=pieces,
                )
            )
        return events

    def close_items(self, incomplete: bool) -> list[dict[str, Any]]:
        events = []
        for index, item in enumerate(self.output):
            if item.status == "in_progress":
                events += self.close_item(index, incomplete)
        return events

    def close_reasoning(self) -> list[dict[str, Any]]:
        """The thinking ended where an answer item begins: its item is done before that one."""
        if self.reasoning is None or self.reasoning.status != "in_progress":
            return []
        return self.close_item(self.output.index(self.reasoning), incomplete=False)

    def close_item(self, index: int, incomplete: bool) -> list[dict[str, Any]]:
        item = self.output[index]
        where = {"item_id": item.id, "output_index": index}
        if isinstance(item, OutputReasoning):
            part = item.content[0]
            events = [
                self.event(
                    "response.reasoning_text.done", **where, content_index=0, text=part.text
                ),
                self.event(
                    "response.content_part.done", **where, content_index=0, part=part.model_dump()
                ),
            ]
            item.status = "incomplete" if incomplete else "completed"
        elif isinstance(item, OutputMessage):
            part = item.content[0]
            # Both events name the same content part: the message's one output_text.
            events = [
                self.event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=part.text,
                    logprobs=[],
                ),
                self.event(
                    "response.content_part.done", **where, content_index=0, part=part.model_dump()
                ),
            ]
            item.status = "incomplete" if incomplete else "completed"
        else:
            events = [
                self.event(
                    "response.function_call_arguments.done", **where, arguments=item.arguments
                )
            ]
            item.status = "completed"
        events.append(self.event("response.output_item.done", output_index=index, item=_dump(item)))
        return events


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


def output_items(message: Any, incomplete: bool) -> list[OutputItem]:
    """A chat completion's message as output items: its reasoning, if any (a streamed
    response has that item only when there was some to stream), its text, then one item
    per tool call."""
    calls = [_as_dict(c) for c in getattr(message, "tool_calls", None) or []]
    items: list[OutputItem] = []
    if getattr(message, "reasoning_content", None):
        cut = incomplete and not (message.content or calls)  # max_output_tokens hit the thinking
        items.append(
            OutputReasoning(
                id=new_id("rs_"),
                status="incomplete" if cut else "completed",
                content=[ReasoningText(text=message.reasoning_content)],
            )
        )
    if message.content or not calls:
        items.append(
            OutputMessage(
                id=new_id("msg_"),
                status="incomplete" if incomplete else "completed",
                content=[OutputText(text=message.content or "")],
            )
        )
    for call in calls:
        fn = call.get("function") or {}
        args = fn.get("arguments", "")
        items.append(
            OutputFunctionCall(
                id=new_id("fc_"),
                call_id=call.get("id") or new_id("call_"),
                name=fn.get("name", ""),
                arguments=args if isinstance(args, str) else json.dumps(args),
            )
        )
    return items


def response_usage(chat: Usage) -> ResponseUsage:
    """A chat completion's usage in Responses names."""
    details = chat.completion_tokens_details
    return ResponseUsage(
        input_tokens=chat.prompt_tokens,
        output_tokens=chat.completion_tokens,
        output_tokens_details=OutputTokensDetails(
            reasoning_tokens=details.reasoning_tokens if details else 0
        ),
        total_tokens=chat.total_tokens,
    )


def response_object(
    req: ResponsesRequest,
    response_id: str,
    *,
    output: list[OutputItem],
    incomplete: bool = False,
    usage: ResponseUsage | None = None,
    error: ResponseError | None = None,
    episode_id: str | None = None,
    policy_version: int | None = None,
    completion_id: str | None = None,
) -> ResponsesResponse:
    return ResponsesResponse(
        id=response_id,
        status="incomplete" if incomplete else "completed",
        error=error,
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if incomplete else None,
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        model=req.model,
        output=output,
        parallel_tool_calls=True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        previous_response_id=req.previous_response_id,
        store=req.store is not False,
        temperature=1.0 if req.temperature is None else req.temperature,
        tool_choice=req.tool_choice or "auto",
        tools=req.tools or [],
        top_p=1.0 if req.top_p is None else req.top_p,
        usage=usage,
        user=req.user,
        metadata=req.metadata or {},
        episode_id=episode_id,
        policy_version=policy_version,
        completion_id=completion_id,
    )


@contextlib.contextmanager
def chat_params_renamed() -> Iterator[None]:
    """Errors the chat service raises name chat fields; a Responses caller knows other names."""
    try:
        yield
    except APIError as exc:
        exc.param = CHAT_TO_RESPONSES_PARAM.get(exc.param or "", exc.param)
        raise


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def _as_dict(value: Any) -> dict[str, Any]:
    return value.model_dump() if isinstance(value, BaseModel) else dict(value)


def _dump(item: BaseModel) -> dict[str, Any]:
    return item.model_dump(mode="json")


def _first_error(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()))
        return f"{where}: {err.get('msg')}" if where else str(err.get("msg"))
    return str(exc)
