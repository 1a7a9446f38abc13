"""OpenAI-compatible endpoints, also mounted under path-scoped episode prefixes."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from gateway.deps import RunDep
from gateway.errors import APIError, InvalidRequest, NotFound
from gateway.protocol import ChatCompletion, ChatCompletionRequest, ModelCard, ModelList
from gateway.services.episodes import EpisodeRef
from gateway.services.streaming import ChatStream

logger = logging.getLogger(__name__)

router = APIRouter()


def episode_ref(request: Request) -> EpisodeRef:
    """Path first, then headers; the service falls back to `metadata`, then prefix matching."""
    p, h = request.path_params, request.headers
    return EpisodeRef(
        episode_id=p.get("episode_id") or h.get("x-episode-id") or None,
        group_id=p.get("group_id") or h.get("x-group-id") or None,
        source="path" if p.get("episode_id") else "header",
    )


async def sse(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
    except APIError as exc:
        # The status line went out with the first chunk: OpenAI's in-stream error event
        # (e.g. the database gone before the completion could be stored), and no [DONE].
        logger.warning("stream ended by an error: %s", exc.message)
        yield f"data: {json.dumps(exc.body(), separators=(',', ':'))}\n\n"
        return
    yield "data: [DONE]\n\n"


@router.post("/v1/chat/completions", response_model=ChatCompletion)
async def chat_completions(
    body: ChatCompletionRequest, run: RunDep, request: Request, response: Response
) -> ChatCompletion | StreamingResponse:
    if body.unknown_fields():
        logger.info("ignoring unknown chat fields: %s", body.unknown_fields())
    if body.model not in (run.name, run.model, run.id):
        raise NotFound(
            f"model {body.model!r} is not served for this key; use {run.name!r}",
            param="model",
            code="model_not_found",
        )
    ref = episode_ref(request)
    if body.stream:
        if (body.n or 1) > 1:
            raise InvalidRequest("stream=true with n > 1 is not supported yet", param="n")
        prep = await request.app.state.chat.prepare(run, body, ref)
        stream = ChatStream(request.app.state.chat, prep)
        return StreamingResponse(
            sse(stream.chunks()),
            media_type="text/event-stream",
            headers={"X-Rlgate-Episode-Id": prep.placement.episode_id, "Cache-Control": "no-cache"},
        )
    resp = await request.app.state.chat.create(run, body, ref)
    if resp.episode_id is not None:
        response.headers["X-Rlgate-Episode-Id"] = resp.episode_id
    if resp.group_id is not None:
        response.headers["X-Rlgate-Group-Id"] = resp.group_id
    return resp


@router.get("/v1/models", response_model=ModelList)
async def list_models(run: RunDep) -> ModelList:
    return ModelList(data=[ModelCard(id=run.name, created=int(run.created_at.timestamp()))])
