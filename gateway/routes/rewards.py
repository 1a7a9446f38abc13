"""POST /v1/rewards: a reward for a completion or an episode of the caller's run."""

from __future__ import annotations

from fastapi import APIRouter, Request

from gateway.deps import RunDep
from gateway.protocol import RewardAck, RewardRequest

router = APIRouter()


@router.post("/v1/rewards", response_model=RewardAck)
async def post_reward(body: RewardRequest, run: RunDep, request: Request) -> RewardAck:
    ack = await request.app.state.rewards.post(run, body)
    if ack.episode_status == "rewarded":
        await request.app.state.scheduler.maybe_schedule(run.id)
    return ack
