"""POST /v1/responses and GET /v1/responses/{id}, also mounted under episode prefixes."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import StreamingResponse

from gateway.agent.responses import ResponsesService
from gateway.agent.route import AgentRoute
from gateway.agent.sse import answer
from gateway.deps import EpisodeRefDep, RunDep, check_request
from gateway.protocol_responses import ResponsesRequest, ResponsesResponse

router = APIRouter(route_class=AgentRoute)  # the hot path: gateway.agent.route


async def responses_service(request: Request) -> ResponsesService:
    return ResponsesService(request.app.state.chat, request.app.state.sessions)


ServiceDep = Annotated[ResponsesService, Depends(responses_service)]


@router.post("/v1/responses", response_model=ResponsesResponse)
async def create_response(
    body: ResponsesRequest,
    run: RunDep,
    service: ServiceDep,
    ref: EpisodeRefDep,
    request: Request,
    response: Response,
) -> ResponsesResponse | StreamingResponse:
    run = await check_request(request, run, body, "responses")
    return await answer(service, run, body, ref, response, stream=bool(body.stream))


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, run: RunDep, service: ServiceDep) -> dict[str, Any]:
    return await service.retrieve(run, response_id)
