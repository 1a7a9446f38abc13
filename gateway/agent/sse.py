"""Server-sent events as OpenAI streams them, the streaming answer that carries them, and the
one way an API family's route answers (a stream or a whole answer)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol, TypeVar

from fastapi import Response
from fastapi.responses import StreamingResponse

from core.store.models import Run
from gateway.agent.episodes import EpisodeRef
from gateway.errors import APIError
from gateway.identifiers import header_value

logger = logging.getLogger(__name__)


# json.dumps with `separators` builds a new encoder on every call; a stream sends one per chunk.
_json = json.JSONEncoder(separators=(",", ":")).encode


async def sse(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Chat and text completion chunks: `data: <json>` each, then `data: [DONE]`."""
    try:
        async for chunk in chunks:
            yield f"data: {_json(chunk)}\n\n"
    except APIError as exc:
        # The status line went out with the first chunk: OpenAI's in-stream error event
        # (e.g. the database gone before the completion could be stored), and no [DONE].
        logger.warning("stream ended by an error: %s", exc.message)
        yield f"data: {_json(exc.body())}\n\n"
        return
    yield "data: [DONE]\n\n"


async def sse_events(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Responses events as OpenAI sends them: `event: <type>` and `data: <json>`, no [DONE]."""
    async for event in events:
        yield f"event: {event['type']}\ndata: {_json(event)}\n\n"


def event_stream(lines: AsyncIterator[str], episode_id: str) -> StreamingResponse:
    """The streaming answer; the episode id goes in a header as the body has no room for it."""
    return StreamingResponse(
        lines,
        media_type="text/event-stream",
        headers={"X-Rlgate-Episode-Id": header_value(episode_id), "Cache-Control": "no-cache"},
    )


class Answer(Protocol):
    @property
    def episode_id(self) -> str | None: ...


Req = TypeVar("Req", contravariant=True)
Resp = TypeVar("Resp", bound=Answer, covariant=True)


class Family(Protocol[Req, Resp]):
    """An API family's service: a whole answer, or a stream opened before its first byte."""

    async def create(self, run: Run, req: Req, ref: EpisodeRef) -> Resp: ...

    async def start_stream(self, run: Run, req: Req, ref: EpisodeRef) -> StreamingResponse: ...


async def answer(
    service: Family[Req, Resp],
    run: Run,
    body: Req,
    ref: EpisodeRef,
    response: Response,
    *,
    stream: bool,
) -> Resp | StreamingResponse:
    """The route's answer; a whole one names its episode in a header, as a stream does."""
    if stream:
        return await service.start_stream(run, body, ref)
    resp = await service.create(run, body, ref)
    if resp.episode_id is not None:
        response.headers["X-Rlgate-Episode-Id"] = header_value(resp.episode_id)
    return resp
