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

from gateway.errors import backend_failure
from gateway.protocol import Usage
from gateway.services.completions import ChatService, Prepared, chat_usage, finish_reason
from gateway.store.models import Completion
from inference.backend import BackendError, TokenStream
from inference.reasoning import ThinkStream
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

    Each token decodes a window of the last few ids, not the whole list (which
    made a stream quadratic: 1,024 tokens took ~100 ms of event-loop time). As
    in vLLM's `detokenize_incrementally`, the new text is the decode of the
    window from `_prefix` minus the decode of its part before `_read`: both
    start at the same id, so a tokenizer that treats a decode's first token
    specially (SentencePiece drops its leading space) does so in both. `flush`
    decodes the whole list once, as the stored completion does.
    """

    def __init__(self, decode, stop: tuple[str, ...] = ()) -> None:
        self.decode = decode
        self.stop = stop
        self.ids: list[int] = []
        self.sent = ""
        self._text = ""  # the decoded text of ids[:_read]
        self._prefix = 0  # the window starts here...
        self._read = 0  # ...and its text up to here is in `_text` already

    def _visible(self, text: str, final: bool) -> str:
        cut = truncate_at_stop(text, self.stop)
        if cut != text or final:
            return cut
        hold = max(
            (k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0
        )
        return text[: len(text) - hold]

    def push(self, token: int) -> str:
        self.ids.append(token)
        window = self.decode(self.ids[self._prefix :])
        if window.endswith("\ufffd"):
            return ""  # an unfinished character: wait for its next bytes
        before = self.decode(self.ids[self._prefix : self._read])
        if window.startswith(before):
            self._text += window[len(before) :]
        else:  # the window does not extend its own prefix: read the whole list
            self._text = self.decode(self.ids)
        self._prefix, self._read = self._read, len(self.ids)
        return self._advance(self._visible(self._text, final=False))

    def flush(self) -> str:
        return self._advance(self._visible(self.decode(self.ids), final=True))

    def _advance(self, visible: str) -> str:
        if not visible.startswith(self.sent):
            return ""
        piece, self.sent = visible[len(self.sent) :], visible
        return piece


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
