"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's API), also under episode prefixes.

Errors under these paths are in Anthropic's shape (`gateway.errors`); the
`anthropic-version` and `anthropic-beta` headers are accepted and not read.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import StreamingResponse

from gateway.agent.messages import MessagesService
from gateway.agent.route import AgentRoute
from gateway.agent.sse import answer
from gateway.deps import EpisodeRefDep, RunDep, check_request
from gateway.protocol_messages import (
    CountTokensRequest,
    MessageResponse,
    MessagesRequest,
    TokenCount,
)

router = APIRouter(route_class=AgentRoute)  # the hot path: gateway.agent.route


async def messages_service(request: Request) -> MessagesService:
    return MessagesService(request.app.state.chat)


ServiceDep = Annotated[MessagesService, Depends(messages_service)]


@router.post("/v1/messages", response_model=MessageResponse)
async def create_message(
    body: MessagesRequest,
    run: RunDep,
    service: ServiceDep,
    ref: EpisodeRefDep,
    request: Request,
    response: Response,
) -> MessageResponse | StreamingResponse:
    run = await check_request(request, run, body, "messages")
    return await answer(service, run, body, ref, response, stream=bool(body.stream))


@router.post("/v1/messages/count_tokens", response_model=TokenCount)
async def count_tokens(
    body: CountTokensRequest, run: RunDep, service: ServiceDep, request: Request
) -> TokenCount:
    run = await check_request(request, run, body, "count_tokens")
    return await service.count_tokens(run, body)
