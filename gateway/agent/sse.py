"""Server-sent events as OpenAI streams them, and the streaming answer that carries them."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from gateway.errors import APIError
from gateway.identifiers import header_value

logger = logging.getLogger(__name__)


def _json(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


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
