"""OpenAI's Responses API on the wire: the streamed events and the response object.

The stream is `response.created` and `response.in_progress`, then per
output item (a `reasoning` item while the run thinks, the `message`, one
`function_call` per tool call) its `output_item.added`, content part and
deltas, and its `*.done` events once the next item begins or sampling ends;
then `response.completed` (or `response.incomplete` when `max_output_tokens`
cut it) with the whole response, its usage counting thinking tokens in
`output_tokens_details.reasoning_tokens`. A backend failure mid-stream is
`response.failed`.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from core.store.models import Completion
from gateway.agent.encoders.chat import chat_usage, finish_reason
from gateway.agent.events import ReasoningDelta, StreamEncoder, TextDelta, ToolCallDelta
from gateway.errors import APIError
from gateway.protocol_responses import (
    IncompleteDetails,
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
)

if TYPE_CHECKING:
    from gateway.agent.completions import Prepared

logger = logging.getLogger(__name__)

Event = dict[str, Any]


class ResponseEvents(StreamEncoder[Event]):
    """The events of one streamed response, as JSON-ready dicts; `response` is the finished
    response once `Done` was fed (the caller stores it before the last event goes out)."""

    def __init__(self, req: ResponsesRequest, prep: Prepared, completion_id: str) -> None:
        self.req = req
        self.prep = prep
        self.completion_id = completion_id  # known from the start: a cut stream is stored under it
        self.id = new_id("resp_")
        self.seq = 0
        self.output: list[OutputItem] = []
        self.reasoning_item: OutputReasoning | None = None  # the thinking being streamed
        self.message: OutputMessage | None = None  # the text item being streamed
        self.calls: dict[int, OutputFunctionCall] = {}  # tool calls being streamed, by index
        self.response: ResponsesResponse | None = None

    def start(self) -> list[Event]:
        return [
            self.event("response.created", response=self.snapshot("in_progress")),
            self.event("response.in_progress", response=self.snapshot("in_progress")),
        ]

    def text(self, delta: TextDelta) -> list[Event]:
        return self.text_delta(delta.text) if delta.text else []

    def reasoning(self, delta: ReasoningDelta) -> list[Event]:
        return self.reasoning_delta(delta.text) if delta.text else []

    def tool_call(self, delta: ToolCallDelta) -> list[Event]:
        return self.call_delta(delta.index, delta.call)

    def error(self, error: APIError) -> list[Event]:
        logger.warning("response stream %s failed: %s", self.id, error.message)
        failed = ResponseError(code="server_error", message="the inference backend failed")
        return [self.event("response.failed", response=self.snapshot("failed", error=failed))]

    def done(self, row: Completion) -> list[Event]:
        incomplete = finish_reason(row) == "length"
        events = []
        if self.message is None and not self.calls:  # no answer: a cut hit the thinking
            events += [*self.close_items(incomplete), *self.text_delta("")]
        events += self.close_items(incomplete)
        self.response = final_response(self.req, self.id, self.prep, row, self.output, incomplete)
        kind = "response.incomplete" if incomplete else "response.completed"
        return [*events, self.event(kind, response=self.response.model_dump(mode="json"))]

    def event(self, kind: str, **fields: Any) -> Event:
        out = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return out

    def snapshot(self, status: str, **fields: Any) -> Event:
        resp = response_object(
            self.req,
            self.id,
            output=list(self.output),
            episode_id=self.prep.placement.episode_id,
            completion_id=self.completion_id,
            **fields,
        )
        return resp.model_copy(update={"status": status}).model_dump(mode="json")

    def open_item(self, item: OutputReasoning | OutputMessage) -> list[Event]:
        """Append `item`, whose one content part is empty: the two events that announce it."""
        self.output.append(item)
        index = len(self.output) - 1
        part = item.content[0]
        empty = item.model_copy(update={"content": []})  # announced before its part
        added = self.event("response.output_item.added", output_index=index, item=_dump(empty))
        part_added = self.event(
            "response.content_part.added",
            item_id=item.id,
            output_index=index,
            content_index=0,
            part=part.model_dump(),
        )
        return [added, part_added]

    def reasoning_delta(self, piece: str) -> list[Event]:
        """Thinking text: opens the reasoning item, then streams its text."""
        events = []
        if self.reasoning_item is None:
            self.reasoning_item = OutputReasoning(
                id=new_id("rs_"), status="in_progress", content=[ReasoningText(text="")]
            )
            events += self.open_item(self.reasoning_item)
        self.reasoning_item.content[0].text += piece
        events.append(self.delta("response.reasoning_text.delta", self.reasoning_item, piece))
        return events

    def text_delta(self, piece: str) -> list[Event]:
        events = []
        if self.message is None:
            events += self.close_reasoning()
            self.message = OutputMessage(
                id=new_id("msg_"), status="in_progress", content=[OutputText(text="")]
            )
            events += self.open_item(self.message)
        if piece:
            self.message.content[0].text += piece
            events.append(
                self.delta("response.output_text.delta", self.message, piece, logprobs=[])
            )
        return events

    def delta(self, kind: str, item: OutputItem, piece: str, **fields: Any) -> Event:
        index = self.output.index(item)
        return self.event(
            kind, item_id=item.id, output_index=index, content_index=0, delta=piece, **fields
        )

    def call_delta(self, index: int, call: dict[str, Any]) -> list[Event]:
        """A parsed tool call: its function_call item, then its arguments."""
        events = self.close_reasoning()
        fn = call.get("function") or {}
        item = OutputFunctionCall(
            id=new_id("fc_"),
            call_id=call.get("id") or new_id("call_"),
            name=fn.get("name") or "",
            arguments="",
            status="in_progress",
        )
        self.calls[index] = item
        self.output.append(item)
        at = len(self.output) - 1
        events.append(self.event("response.output_item.added", output_index=at, item=_dump(item)))
        args = _arguments(fn.get("arguments"))
        if args:
            item.arguments += args
            events.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=item.id,
                    output_index=at,
                    delta=args,
                )
            )
        return events

    def close_items(self, incomplete: bool) -> list[Event]:
        events = []
        for index, item in enumerate(self.output):
            if item.status == "in_progress":
                events += self.close_item(index, incomplete)
        return events

    def close_reasoning(self) -> list[Event]:
        """The thinking ended where an answer item begins: its item is done before that one."""
        if self.reasoning_item is None or self.reasoning_item.status != "in_progress":
            return []
        return self.close_item(self.output.index(self.reasoning_item), incomplete=False)

    def close_item(self, index: int, incomplete: bool) -> list[Event]:
        item = self.output[index]
        where = {"item_id": item.id, "output_index": index}
        if isinstance(item, OutputFunctionCall):
            events = [
                self.event(
                    "response.function_call_arguments.done", **where, arguments=item.arguments
                )
            ]
            item.status = "completed"
        else:
            part = item.content[0]
            # Both events name the same content part: the item's one text part.
            text_done = (
                self.event("response.reasoning_text.done", **where, content_index=0, text=part.text)
                if isinstance(item, OutputReasoning)
                else self.event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=part.text,
                    logprobs=[],
                )
            )
            events = [
                text_done,
                self.event(
                    "response.content_part.done", **where, content_index=0, part=part.model_dump()
                ),
            ]
            item.status = "incomplete" if incomplete else "completed"
        events.append(self.event("response.output_item.done", output_index=index, item=_dump(item)))
        return events


def output_items(row: Completion, incomplete: bool) -> list[OutputItem]:
    """A stored answer as output items: its reasoning, if any (a streamed response has that
    item only when there was some to stream), its text, then one item per tool call."""
    calls = row.tool_calls or []
    items: list[OutputItem] = []
    if row.reasoning_content:
        cut = incomplete and not (row.content or calls)  # max_output_tokens hit the thinking
        items.append(
            OutputReasoning(
                id=new_id("rs_"),
                status="incomplete" if cut else "completed",
                content=[ReasoningText(text=row.reasoning_content)],
            )
        )
    if row.content or not calls:
        items.append(
            OutputMessage(
                id=new_id("msg_"),
                status="incomplete" if incomplete else "completed",
                content=[OutputText(text=row.content or "")],
            )
        )
    for call in calls:
        fn = call.get("function") or {}
        items.append(
            OutputFunctionCall(
                id=new_id("fc_"),
                call_id=call.get("id") or new_id("call_"),
                name=fn.get("name", ""),
                arguments=_arguments(fn.get("arguments", "")),
            )
        )
    return items


def final_response(
    req: ResponsesRequest,
    response_id: str,
    prep: Prepared,
    row: Completion,
    output: list[OutputItem],
    incomplete: bool,
) -> ResponsesResponse:
    """The finished response of the answer stored as `row`."""
    usage = chat_usage([row], prep.serving.template.decode)
    details = usage.completion_tokens_details
    return response_object(
        req,
        response_id,
        output=output,
        incomplete=incomplete,
        usage=ResponseUsage(
            input_tokens=usage.prompt_tokens,
            output_tokens=usage.completion_tokens,
            output_tokens_details=OutputTokensDetails(
                reasoning_tokens=details.reasoning_tokens if details else 0
            ),
            total_tokens=usage.total_tokens,
        ),
        episode_id=row.episode_id,
        policy_version=row.policy_version,
        version_starts=row.version_starts,
        completion_id=row.id,
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
    version_starts: list[list[int]] | None = None,
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
        version_starts=version_starts,
        completion_id=completion_id,
    )


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def _arguments(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps(args)


def _dump(item: BaseModel) -> dict[str, Any]:
    return item.model_dump(mode="json")
