"""POST /v1/completions (legacy text completions), also mounted under episode prefixes."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from gateway.agent.route import AgentRoute
from gateway.agent.sse import answer
from gateway.agent.text_completions import TextCompletionService
from gateway.deps import EpisodeRefDep, RunDep, check_request
from gateway.protocol_legacy import CompletionRequest, TextCompletion

router = APIRouter(route_class=AgentRoute)  # the hot path: gateway.agent.route


@router.post("/v1/completions", response_model=TextCompletion)
async def completions(
    body: CompletionRequest, run: RunDep, ref: EpisodeRefDep, request: Request, response: Response
) -> TextCompletion | StreamingResponse:
    run = await check_request(request, run, body, "completion")
    service = TextCompletionService(request.app.state.chat)
    return await answer(service, run, body, ref, response, stream=bool(body.stream))
