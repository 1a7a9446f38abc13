"""Token-by-token streaming of a chat completion as OpenAI's `chat.completion.chunk`s.

Ordering: the role chunk goes out first; each sampled token is decoded
incrementally and sent as soon as it forms whole characters; when sampling
ends, the completion is STORED, then the finish chunk (and the usage chunk,
if asked for) is sent, then `[DONE]`. A client that disconnects mid-stream
cancels generation at the backend's next step; the partial completion is
stored with finish_reason "cancelled" (the trainer does not train on it).
If the backend fails after tokens were sampled, the stream ends with an
OpenAI-style error event (`{"error": {...}}`) and nothing is stored.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import anyio

from core.store.models import Completion
from gateway.agent.completions import ChatService, Prepared, chat_usage, finish_reason
from gateway.errors import backend_failure
from gateway.protocol import Usage
from inference.backend import BackendError, TokenStream
from inference.detokenize import Detokenizer
from inference.reasoning import ThinkStream
from inference.stop_strings import StopMatcher
from inference.types import GenerateRequest, GenerateResult, truncate_at_stop

logger = logging.getLogger(__name__)


async def keep_partial(stream: TokenStream, store, label: str) -> None:
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

    def __init__(self, decode, stop: tuple[str, ...] = ()) -> None:
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


class BackendStream:
    """What chat and text streaming share; subclasses yield their chunks from `_chunks()`.

    The backend stream starts in `__init__`, and the route awaits `open()` (the first
    token) before it answers: a backend that is full or down before its first token is
    the same plain 429 or 503 as without streaming (`gateway.errors.backend_failure`),
    not an error event after a 200. `chunks()` turns a later failure into an in-stream
    error event and, if the completion was not stored (a disconnect or that failure),
    keeps what was sampled via `keep_partial`.
    """

    def __init__(self, chat: ChatService, prep: Prepared, completion_id: str) -> None:
        self.chat = chat
        self.prep = prep
        self.id = completion_id
        self.created = int(time.time())
        try:
            self.stream: TokenStream = prep.serving.backend.start_stream(
                GenerateRequest(prep.prompt_ids, prep.params, prep.placement.episode_id)
            )
        except BackendError as exc:  # e.g. a full queue, no healthy replica: before any byte
            raise backend_failure(exc) from exc
        opts = prep.req.stream_options
        self.include_usage = bool(opts and opts.include_usage)
        self.stored = False
        self._tokens = aiter(self.stream.tokens())
        self._first: tuple[int, float] | None = None

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

    async def tokens(self) -> AsyncIterator[tuple[int, float]]:
        """The backend's (token id, logprob) pairs, the one `open()` took first."""
        if self._first is not None:
            yield self._first
        async for item in self._tokens:
            yield item

    def _chunks(self) -> AsyncIterator[dict[str, Any]]:
        raise NotImplementedError

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        try:
            async with aclosing(self._chunks()) as chunks:
                async for chunk in chunks:
                    yield chunk
        except BackendError as exc:
            # The backend died after this stream had tokens (a replica set retries only
            # before the first one): end with OpenAI's in-stream error event; nothing is stored.
            logger.warning("stream %s broke mid-generation: %s", self.id, exc)
            yield backend_failure(exc).body()
        finally:
            if not self.stored:
                await keep_partial(self.stream, self._store, self.id)

    def usage_chunk(self, chunk: dict[str, Any], result: GenerateResult) -> dict[str, Any]:
        """The last chunk when `stream_options.include_usage` is set: `chunk` with no choices."""
        n_prompt, n_out = len(self.prep.prompt_ids), len(result.output_token_ids)
        usage = Usage(
            prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out
        )
        return {**chunk, "choices": [], "usage": usage.model_dump()}

    async def _store(self, result: GenerateResult) -> Completion:
        row = self.chat.completion_row(self.prep, self.id, None, result)
        try:
            await self.chat.store([row], self.prep.placement.group_id)
        except asyncio.CancelledError:
            # The client went away while the row waited for its commit. The writer still
            # commits it (`CaptureWriter.submit` is shielded), so `keep_partial` must not
            # hand it over a second time: the duplicate failed its whole batch, which the
            # writer then redid one transaction per request.
            self.stored = True
            raise
        self.stored = True
        return row


class ChatStream(BackendStream):
    """One streaming call: `chunks()` yields JSON-ready chunk dicts."""

    def __init__(self, chat: ChatService, prep: Prepared, completion_id: str | None = None) -> None:
        super().__init__(chat, prep, completion_id or "chatcmpl-" + uuid.uuid4().hex)

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, logprobs=None) -> dict:
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.prep.req.model,
            "system_fingerprint": f"rlgate-{self.prep.run.id}-v{self.prep.serving.backend.version}",
            "choices": [
                {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            ],
            # --- rlgate extension: the episode this call is filed under
            "episode_id": self.prep.placement.episode_id,
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _logprobs(self, pending: list[tuple[int, float]]) -> dict | None:
        if not self.prep.req.logprobs:
            return None
        tok = self.prep.serving.template.tokenizer
        return {"content": [{"token": tok.decode([t]), "logprob": lp} for t, lp in pending]}

    async def _chunks(self) -> AsyncIterator[dict[str, Any]]:
        decoder = IncrementalDecoder(self.prep.serving.template.decode, self.prep.params.stop)
        # With reasoning parsed, the text is split as it comes: `reasoning_content` deltas
        # inside <think>, then `content` deltas (`ThinkStream` holds back only what could
        # still be a tag, or whitespace the split strips).
        think = ThinkStream(self.prep.think_open) if self.prep.reasoning else None
        # With tools offered, the answer may turn out to be a tool call: it is held back
        # and sent, parsed, once sampling ends (tool calls arrive whole, one delta each).
        hold = self.prep.tool_parser is not None
        yield self._chunk({"role": "assistant", "content": ""})
        pending: list[tuple[int, float]] = []  # sampled, not yet on a chunk's logprobs
        async for token, logprob in self.tokens():
            pending.append((token, logprob))
            piece = decoder.push(token)
            reasoning, content = think.push(piece) if think and piece else ("", piece)
            for delta in _deltas(reasoning, "" if hold else content):
                yield self._chunk(delta, logprobs=self._logprobs(pending))
                pending = []
        result = await self.stream.result()
        rest = decoder.flush()
        row = await self._store(result)
        reasoning, content = (
            ("", rest) if think is None else _joined(think.push(rest), think.flush())
        )
        if hold:
            content = row.content
        # The last sampled tokens' logprobs ride on the first of these, or an empty one.
        deltas = _deltas(reasoning, content) or ([{"content": ""}] if pending else [])
        for delta in deltas:
            yield self._chunk(delta, logprobs=self._logprobs(pending))
            pending = []
        for i, call in enumerate(row.tool_calls or []):
            yield self._chunk({"tool_calls": [{"index": i, **call}]})
        yield self._chunk({}, finish_reason(row))
        if self.include_usage:
            chunk = self.usage_chunk(self._chunk({}), result)
            chunk["usage"] = chat_usage([row], self.prep.serving.template.decode).model_dump()
            yield chunk
        logger.debug("streamed %s (%d tokens)", row.id, len(result.output_token_ids))


def _deltas(reasoning: str, content: str) -> list[dict[str, str]]:
    """The chunk deltas for some split text: its reasoning first, then its answer."""
    out = [{"reasoning_content": reasoning}] if reasoning else []
    return [*out, {"content": content}] if content else out


def _joined(*parts: tuple[str, str]) -> tuple[str, str]:
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)
