"""Admin API: a run's episodes, filtered, and one episode down to its tokens."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from gateway.deps import AdminDep
from gateway.protocol_admin import EpisodeDetail, EpisodePage
from gateway.store.status import EpisodeStatus

router = APIRouter(prefix="/admin/v1", dependencies=[AdminDep], tags=["admin"])


@router.get("/runs/{run_id}/episodes", response_model=EpisodePage)
async def list_episodes(
    run_id: str,
    request: Request,
    status: Annotated[EpisodeStatus | None, Query()] = None,
    reward_min: Annotated[float | None, Query(allow_inf_nan=False)] = None,
    reward_max: Annotated[float | None, Query(allow_inf_nan=False)] = None,
    version: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    after: Annotated[str | None, Query(max_length=100)] = None,
) -> EpisodePage:
    """Newest first. `version`: episodes with a turn sampled by that policy version."""
    return await request.app.state.episode_admin.list(
        run_id,
        status=status,
        reward_min=reward_min,
        reward_max=reward_max,
        version=version,
        limit=limit,
        after=after,
    )


@router.get("/runs/{run_id}/episodes/{episode_id}", response_model=EpisodeDetail)
async def get_episode(run_id: str, episode_id: str, request: Request) -> EpisodeDetail:
    """Messages, tool calls, token ids, decoded tokens, logprobs, loss mask and rewards."""
    return await request.app.state.episode_admin.detail(run_id, episode_id)
