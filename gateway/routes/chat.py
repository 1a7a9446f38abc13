"""POST /v1/chat/completions, also mounted under path-scoped episode prefixes."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from gateway.agent.completions import new_chat_id
from gateway.agent.encoders.chat import ChatChunks
from gateway.agent.events import encoded
from gateway.agent.route import AgentRoute
from gateway.agent.sse import event_stream, sse
from gateway.agent.streaming import SampleStream
from gateway.deps import EpisodeRefDep, RunDep, check_request
from gateway.errors import InvalidRequest
from gateway.identifiers import header_value
from gateway.protocol import ChatCompletion, ChatCompletionRequest

router = APIRouter(route_class=AgentRoute)  # the hot path: gateway.agent.route


@router.post("/v1/chat/completions", response_model=ChatCompletion)
async def chat_completions(
    body: ChatCompletionRequest,
    run: RunDep,
    ref: EpisodeRefDep,
    request: Request,
    response: Response,
) -> ChatCompletion | StreamingResponse:
    run = await check_request(request, run, body, "chat")
    chat = request.app.state.chat
    if body.stream:
        if (body.n or 1) > 1:
            raise InvalidRequest("stream=true with n > 1 is not supported yet", param="n")
        prep = await chat.prepare(run, body, ref)
        stream = SampleStream(chat, prep, new_chat_id())
        await stream.open()
        chunks = ChatChunks(body, prep, stream.id, stream.created)
        return event_stream(sse(encoded(stream.events(), chunks)), stream.episode_id)
    resp = await chat.create(run, body, ref)
    if resp.episode_id is not None:
        response.headers["X-Rlgate-Episode-Id"] = header_value(resp.episode_id)
    if resp.group_id is not None:
        response.headers["X-Rlgate-Group-Id"] = header_value(resp.group_id)
    return resp
