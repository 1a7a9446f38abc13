"""POST /v1/rewards: a reward for a completion or an episode of the caller's run."""

from __future__ import annotations

from fastapi import APIRouter, Request

from gateway.deps import RunDep
from gateway.errors import InvalidRequest
from gateway.protocol import RewardAck, RewardRequest

router = APIRouter()


@router.post("/v1/rewards", response_model=RewardAck)
async def post_reward(body: RewardRequest, run: RunDep, request: Request) -> RewardAck:
    if body.completion_id is None and body.episode_id is None:
        path_episode = request.path_params.get("episode_id")
        if path_episode is None:
            raise InvalidRequest("give one of completion_id or episode_id", param="episode_id")
        body = body.model_copy(update={"episode_id": path_episode})
    ack = await request.app.state.rewards.post(run, body)
    if ack.episode_status == "rewarded":
        await request.app.state.scheduler.maybe_schedule(run.id)
    return ack
