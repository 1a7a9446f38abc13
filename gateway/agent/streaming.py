"""The sampling core of a streamed completion: backend tokens in, typed events out.

Ordering: each sampled token is decoded incrementally and its text sent as
soon as it forms whole characters; when sampling ends, the completion is
STORED, then what was held back (parsed tool calls, the tail of a split)
goes out, then `Done` with the stored row. A client that disconnects
mid-stream cancels generation at the backend's next step; the partial
completion is stored with finish_reason "cancelled" (the trainer does not
train on it). If the backend fails after tokens were sampled, the events end
with `StreamError` and nothing is stored. The event types and their order
are `gateway.agent.events`; each API family encodes them
(`gateway.agent.encoders`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable

import anyio

from core.store.models import Completion
from gateway.agent.completions import ChatService, Prepared
from gateway.agent.events import (
    Done,
    ReasoningDelta,
    StreamError,
    StreamEvent,
    TextDelta,
    Token,
    ToolCallDelta,
)
from gateway.errors import backend_failure
from inference.backend import BackendError, TokenStream
from inference.detokenize import Detokenizer
from inference.reasoning import ThinkStream
from inference.stop_strings import StopMatcher
from inference.types import GenerateRequest, GenerateResult, truncate_at_stop

logger = logging.getLogger(__name__)


async def keep_partial(
    stream: TokenStream, store: Callable[[GenerateResult], Awaitable[object]], label: str
) -> None:
    """After a disconnect (or failure) mid-stream: stop sampling, store what was sampled.

    Shielded: the request's task is being cancelled, and the store must still happen.
    """
    with anyio.CancelScope(shield=True):
        stream.cancel()
        try:
            await store(await stream.result())
        except BackendError:
            logger.warning("stream %s failed before anything could be stored", label)


class IncrementalDecoder:
    """Text deltas of a growing id list.

    Holds back the bytes of an unfinished character, and any tail that could
    be the start of a stop string; never sends a stop string or what follows.

    Work per token does not grow with the text: a few ids are decoded
    (`inference.detokenize.Detokenizer`), the new characters are fed to a stop
    automaton (`inference.stop_strings.StopMatcher`), and only the unsent tail
    (at most the held-back characters and the new ones) is kept as a string.
    `flush` decodes the whole list once, as the stored completion does.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = ()) -> None:
        self.decode = decode
        self.stop = stop
        self._text = Detokenizer(decode)
        self._matcher = StopMatcher(stop)
        self._sent: list[str] = []
        self.n_sent = 0  # characters sent
        # The text after what was sent; None while the text (rewritten by a whole decode)
        # does not start with what was sent, when each token reads the whole text again.
        self._tail: str | None = ""

    @property
    def ids(self) -> list[int]:
        return self._text.ids

    @property
    def sent(self) -> str:
        """Everything sent so far (joined here: O(length); `n_sent` is its length)."""
        if len(self._sent) > 1:
            self._sent = ["".join(self._sent)]
        return self._sent[0] if self._sent else ""

    def push(self, token: int) -> str:
        piece = self._text.push(token)
        if piece is None or self._tail is None:
            if piece is None:  # rewritten, not extended: match the whole text again
                self._matcher.reset()
                self._matcher.feed(self._text.text)
            else:
                self._matcher.feed(piece)
            return self._advance_whole(self._text.text, self._matcher.visible())
        if self._matcher.match is not None:
            return ""  # nothing after a stop string is sent, and what is before it went out
        self._matcher.feed(piece)
        self._tail += piece
        n = self._matcher.visible() - self.n_sent
        if n <= 0:
            return ""
        out, self._tail = self._tail[:n], self._tail[n:]
        self._sent.append(out)
        self.n_sent += n
        return out

    def flush(self) -> str:
        text = self.decode(self.ids)
        return self._advance_whole(text, len(truncate_at_stop(text, self.stop)))

    def _advance_whole(self, text: str, visible: int) -> str:
        """The next piece when `text[:visible]` may be sent: what it adds to what was sent."""
        sent = self.sent
        self._tail = text[self.n_sent :] if text.startswith(sent) else None
        if self._tail is None or visible <= self.n_sent:
            return ""
        out = text[self.n_sent : visible]
        self._tail = text[visible:]
        self._sent.append(out)
        self.n_sent = visible
        return out


class SampleStream:
    """One streamed completion: `events()` yields its typed events (`gateway.agent.events`).

    The backend stream starts in `__init__`, and the route awaits `open()` (the first
    token) before it answers: a backend that is full or down before its first token is
    the same plain 429 or 503 as without streaming (`gateway.errors.backend_failure`),
    not an error event after a 200. `events()` turns a later failure into `StreamError`
    and, if the completion was not stored (a disconnect or that failure), keeps what was
    sampled via `keep_partial`.
    """

    def __init__(self, chat: ChatService, prep: Prepared, completion_id: str) -> None:
        self.chat = chat
        self.prep = prep
        self.id = completion_id
        self.created = int(time.time())
        try:
            self.stream: TokenStream = prep.serving.backend.start_stream(
                GenerateRequest(
                    prep.prompt_ids,
                    prep.params,
                    prep.placement.episode_id,
                    version=prep.serving.start_on,
                )
            )
        except BackendError as exc:  # e.g. a full queue, no healthy replica: before any byte
            raise backend_failure(exc) from exc
        self.stored = False
        self._tokens = aiter(self.stream.tokens())
        self._first: tuple[int, float] | None = None

    @property
    def episode_id(self) -> str:
        return self.prep.placement.episode_id

    async def open(self) -> None:
        """Wait for the first token; a backend failure before it raises its HTTP error."""
        try:
            self._first = await anext(self._tokens, None)
        except BackendError as exc:
            self.stored = True  # nothing was sampled: nothing to keep
            raise backend_failure(exc) from exc
        except BaseException:  # the caller went away while it waited
            await keep_partial(self.stream, self._store, self.id)
            raise

    async def events(self) -> AsyncGenerator[StreamEvent, None]:
        prep = self.prep
        decoder = IncrementalDecoder(prep.serving.template.decode, prep.params.stop)
        # With reasoning parsed, the text is split as it comes: reasoning deltas inside
        # <think>, then text deltas (`ThinkStream` holds back only what could still be a
        # tag, or whitespace the split strips).
        think = ThinkStream(prep.think_open) if prep.reasoning else None
        # With tools offered, the answer may turn out to be a tool call: it is held back
        # and sent, parsed, once sampling ends (tool calls arrive whole, one delta each).
        hold = prep.tool_parser is not None
        pending: list[Token] = []  # sampled, not yet on a delta
        item = self._first  # `open()` took the first token
        try:
            # One generator from the backend's tokens to the encoder: this loop runs once
            # per sampled token, and builds a `Token` per token and a delta per piece.
            while item is not None:
                token, logprob = item
                pending.append(Token(token, logprob, decoder.n_sent))
                piece = decoder.push(token)
                if think is not None and piece:
                    reasoning, piece = think.push(piece)
                    if reasoning:
                        yield ReasoningDelta(reasoning, tuple(pending))
                        pending = []
                if piece and not hold:
                    yield TextDelta(piece, tuple(pending))
                    pending = []
                item = await anext(self._tokens, None)
            result = await self.stream.result()
            rest = decoder.flush()
            row = await self._store(result)
            reasoning, content = (
                ("", rest) if think is None else _joined(think.push(rest), think.flush())
            )
            if hold:
                content = row.content
            # The last sampled tokens' logprobs ride on the first of these, or an empty one.
            for delta in _deltas(reasoning, content, pending) or (
                [TextDelta("", tuple(pending))] if pending else []
            ):
                yield delta
            for i, call in enumerate(row.tool_calls or []):
                yield ToolCallDelta(i, call)
            logger.debug("streamed %s (%d tokens)", row.id, len(result.output_token_ids))
            yield Done(row)
        except BackendError as exc:
            # The backend died after this stream had tokens (a replica set retries only
            # before the first one): the encoders end with their error event; nothing is stored.
            logger.warning("stream %s broke mid-generation: %s", self.id, exc)
            yield StreamError(backend_failure(exc))
        finally:
            if not self.stored:
                await keep_partial(self.stream, self._store, self.id)

    async def _store(self, result: GenerateResult) -> Completion:
        row = self.chat.completion_row(self.prep, self.id, None, result)
        try:
            placement = self.prep.placement
            await self.chat.store([row], placement.group_id, evaluation=placement.evaluation)
        except asyncio.CancelledError:
            # The client went away while the row waited for its commit. The writer still
            # commits it (`CaptureWriter.submit` is shielded), so `keep_partial` must not
            # hand it over a second time: the duplicate failed its whole batch, which the
            # writer then redid one transaction per request.
            self.stored = True
            raise
        self.stored = True
        return row


def _deltas(reasoning: str, content: str, tokens: list[Token]) -> list[ReasoningDelta | TextDelta]:
    """The deltas of some split text: its reasoning first, then its answer; `tokens` ride
    on the first."""
    out: list[ReasoningDelta | TextDelta] = []
    if reasoning:
        out.append(ReasoningDelta(reasoning, tuple(tokens)))
    if content:
        out.append(TextDelta(content, () if out else tuple(tokens)))
    return out


def _joined(*parts: tuple[str, str]) -> tuple[str, str]:
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)
