"""POST /v1/responses and GET /v1/responses/{id}, also mounted under episode prefixes."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import StreamingResponse

from gateway.deps import RunDep
from gateway.protocol_responses import ResponsesRequest, ResponsesResponse
from gateway.routes.completions_legacy import check_model
from gateway.routes.openai_api import episode_ref
from gateway.services.responses import ResponsesService

logger = logging.getLogger(__name__)

router = APIRouter()


def responses_service(request: Request) -> ResponsesService:
    return ResponsesService(request.app.state.chat, request.app.state.sessions)


ServiceDep = Annotated[ResponsesService, Depends(responses_service)]


async def sse_events(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Responses events as OpenAI sends them: `event: <type>` and `data: <json>`, no [DONE]."""
    async for event in events:
        yield f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


@router.post("/v1/responses", response_model=ResponsesResponse)
async def create_response(
    body: ResponsesRequest, run: RunDep, service: ServiceDep, request: Request, response: Response
) -> ResponsesResponse | StreamingResponse:
    if body.unknown_fields():
        logger.info("ignoring unknown responses fields: %s", body.unknown_fields())
    check_model(run, body.model)
    ref = episode_ref(request)
    if body.stream:
        stream = await service.start_stream(run, body, ref)
        return StreamingResponse(
            sse_events(stream.events()),
            media_type="text/event-stream",
            headers={"X-Rlgate-Episode-Id": stream.episode_id, "Cache-Control": "no-cache"},
        )
    resp = await service.create(run, body, ref)
    if resp.episode_id is not None:
        response.headers["X-Rlgate-Episode-Id"] = resp.episode_id
    return resp


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, run: RunDep, service: ServiceDep) -> dict[str, Any]:
    return await service.retrieve(run, response_id)
