"""Admin API: a run's episodes, filtered, one episode down to its tokens, and a group."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from gateway.deps import AdminDep
from gateway.protocol_admin import EpisodeDetail, EpisodePage, EpisodeQuery, GroupDetail

router = APIRouter(prefix="/admin/v1", dependencies=[AdminDep], tags=["admin"])


@router.get("/runs/{run_id}/episodes", response_model=EpisodePage)
async def list_episodes(
    run_id: str, request: Request, query: Annotated[EpisodeQuery, Query()]
) -> EpisodePage:
    """Newest first. `version`: episodes with a turn sampled by that policy version;
    `length_*`: tokens sampled over all turns; `drift`: a turn had template drift (or none)."""
    return await request.app.state.episode_admin.list(run_id, query)


@router.get("/runs/{run_id}/groups/{group_id}", response_model=GroupDetail)
async def get_group(run_id: str, group_id: str, request: Request) -> GroupDetail:
    """A group's episodes, oldest first, each turn with its return and advantage."""
    return await request.app.state.episode_admin.group(run_id, group_id)


@router.get("/runs/{run_id}/episodes/{episode_id}", response_model=EpisodeDetail)
async def get_episode(run_id: str, episode_id: str, request: Request) -> EpisodeDetail:
    """Messages, tool calls, token ids, decoded tokens, logprobs, loss mask and rewards."""
    return await request.app.state.episode_admin.detail(run_id, episode_id)
