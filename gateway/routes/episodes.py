"""Admin API: a run's episodes, filtered, one episode down to its tokens, and a group."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from core.store.status import EpisodeStatus
from gateway.deps import AdminDep
from gateway.protocol_admin import EpisodeDetail, EpisodePage, GroupDetail

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
    group_id: Annotated[str | None, Query(min_length=1, max_length=100)] = None,
    length_min: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
    length_max: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
    drift: Annotated[bool | None, Query()] = None,
) -> EpisodePage:
    """Newest first. `version`: episodes with a turn sampled by that policy version;
    `length_*`: tokens sampled over all turns; `drift`: a turn had template drift (or none)."""
    return await request.app.state.episode_admin.list(
        run_id,
        status=status,
        reward_min=reward_min,
        reward_max=reward_max,
        version=version,
        limit=limit,
        after=after,
        group_id=group_id,
        length_min=length_min,
        length_max=length_max,
        drift=drift,
    )


@router.get("/runs/{run_id}/groups/{group_id}", response_model=GroupDetail)
async def get_group(run_id: str, group_id: str, request: Request) -> GroupDetail:
    """A group's episodes, oldest first, each turn with its return and advantage."""
    return await request.app.state.episode_admin.group(run_id, group_id)


@router.get("/runs/{run_id}/episodes/{episode_id}", response_model=EpisodeDetail)
async def get_episode(run_id: str, episode_id: str, request: Request) -> EpisodeDetail:
    """Messages, tool calls, token ids, decoded tokens, logprobs, loss mask and rewards."""
    return await request.app.state.episode_admin.detail(run_id, episode_id)
