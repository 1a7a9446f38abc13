"""POST /v1/completions (legacy text completions), also mounted under episode prefixes."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from gateway.deps import RunDep
from gateway.errors import NotFound
from gateway.protocol_legacy import CompletionRequest, TextCompletion
from gateway.routes.openai_api import episode_ref, sse
from gateway.services.text_completions import TextCompletionService
from gateway.store.models import Run

logger = logging.getLogger(__name__)

router = APIRouter()


def check_model(run: Run, model: str) -> None:
    """The same rule as chat completions: the run's name, its model as given, or its id."""
    if model not in (run.name, run.model, run.id):
        raise NotFound(
            f"model {model!r} is not served for this key; use {run.name!r}",
            param="model",
            code="model_not_found",
        )


@router.post("/v1/completions", response_model=TextCompletion)
async def completions(
    body: CompletionRequest, run: RunDep, request: Request, response: Response
) -> TextCompletion | StreamingResponse:
    if body.unknown_fields():
        logger.info("ignoring unknown completion fields: %s", body.unknown_fields())
    check_model(run, body.model)
    service = TextCompletionService(request.app.state.chat)
    ref = episode_ref(request)
    if body.stream:
        prep = await service.prepare(run, body, ref)
        stream = service.stream(prep)
        return StreamingResponse(
            sse(stream.chunks()),
            media_type="text/event-stream",
            headers={"X-Rlgate-Episode-Id": prep.placement.episode_id, "Cache-Control": "no-cache"},
        )
    resp = await service.create(run, body, ref)
    if resp.episode_id is not None:
        response.headers["X-Rlgate-Episode-Id"] = resp.episode_id
    return resp
