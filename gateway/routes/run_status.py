"""GET /v1/runs/self: where the caller's run and samples stand; also under episode prefixes.

`self` is the run the agent key belongs to (an agent key reaches one run
only). Under `/episodes/{id}/v1` (or with `X-Episode-Id`) the answer includes
that episode and its group; `?episode_id=` and `?group_id=` ask explicitly.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from gateway.deps import EpisodeRefDep, RunDep
from gateway.protocol import RunProgress

router = APIRouter()


@router.get("/v1/runs/self", response_model=RunProgress)
async def run_progress(
    run: RunDep,
    ref: EpisodeRefDep,
    request: Request,
    episode: Annotated[str | None, Query(alias="episode_id", max_length=100)] = None,
    group: Annotated[str | None, Query(alias="group_id", max_length=100)] = None,
) -> RunProgress:
    return await request.app.state.run_status.progress(
        run.id, episode or ref.episode_id, group or ref.group_id
    )
