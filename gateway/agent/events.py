"""What sampling one completion yields, as typed events that each API family encodes.

The sampling core (`gateway.agent.streaming.SampleStream`) turns backend
tokens into these events; the chat, text-completion, Responses and Messages
encoders (`gateway.agent.encoders`) turn them into their wire format. The
order is a contract every encoder relies on:

    (ReasoningDelta | TextDelta)*    while tokens arrive
    -- the completion is STORED here --
    (ReasoningDelta | TextDelta)*    what was held back (tool-call text, an unfinished tag)
    ToolCallDelta*                   the parsed tool calls, one whole call each
    Done                             the stored row

or, if the backend fails after the first token, `StreamError` and nothing
after it (nothing is stored). `Done` carries the row that was stored, so no
encoder reads the store again.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

from core.store.models import Completion
from gateway.errors import APIError


class Token(NamedTuple):
    """One sampled token: its id, its behaviour logprob, and where its text starts.

    A named tuple, not a dataclass: one is made per sampled token, and a tuple is the
    cheapest immutable record to build (a third of a frozen dataclass's time)."""

    id: int
    logprob: float
    offset: int  # characters of the answer sent before this token (text `text_offset`)


@dataclass(frozen=True, slots=True)
class TextDelta:
    """Answer text; `tokens` are the sampled tokens whose logprobs ride on this delta."""

    text: str
    tokens: tuple[Token, ...] = ()


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """Thinking text (inside `<think>`), with the tokens whose logprobs ride on it."""

    text: str
    tokens: tuple[Token, ...] = ()


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """One whole parsed tool call, as stored: `{"id", "type", "function": {name, arguments}}`."""

    index: int
    call: dict[str, Any]


@dataclass(frozen=True, slots=True)
class StreamError:
    """The backend failed mid-stream; `error` is what that failure maps to at the edge."""

    error: APIError


@dataclass(frozen=True, slots=True)
class Done:
    """Sampling ended and `row` is stored: the finish reason, usage and ids all come from it."""

    row: Completion


StreamEvent = TextDelta | ReasoningDelta | ToolCallDelta | StreamError | Done

Out = TypeVar("Out")


class StreamEncoder(Generic[Out]):
    """One API family's streaming wire format: pure, given the call it answers.

    `feed` dispatches each event to the method that encodes its kind; a family that
    never parses reasoning or tool calls keeps the defaults, which send nothing.
    """

    def start(self) -> list[Out]:
        """What goes out before the first event (a role chunk, `message_start`, ...)."""
        return []

    def feed(self, event: StreamEvent) -> list[Out]:
        """What one event becomes on the wire (often nothing, sometimes several items)."""
        match event:
            case TextDelta():
                return self.text(event)
            case ReasoningDelta():
                return self.reasoning(event)
            case ToolCallDelta():
                return self.tool_call(event)
            case StreamError():
                return self.error(event.error)
            case Done():
                return self.done(event.row)

    def text(self, delta: TextDelta) -> list[Out]:
        raise NotImplementedError

    def reasoning(self, delta: ReasoningDelta) -> list[Out]:
        return []

    def tool_call(self, delta: ToolCallDelta) -> list[Out]:
        return []

    def error(self, error: APIError) -> list[Out]:
        raise NotImplementedError

    def done(self, row: Completion) -> list[Out]:
        raise NotImplementedError


async def encoded(
    events: AsyncGenerator[StreamEvent, None], encoder: StreamEncoder[Out]
) -> AsyncIterator[Out]:
    """`events` in `encoder`'s wire format; closing this closes `events` (which then keeps
    a partial sample, `gateway.agent.streaming`)."""
    async with aclosing(events):
        for out in encoder.start():
            yield out
        async for event in events:
            for out in encoder.feed(event):
                yield out
