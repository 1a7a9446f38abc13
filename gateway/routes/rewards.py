"""POST /v1/rewards: a reward for a completion or an episode of the caller's run."""

from __future__ import annotations

from fastapi import APIRouter, Request

from core.store.status import EpisodeStatus
from gateway.agent.policies import declared_policies
from gateway.deps import RunDep
from gateway.errors import InvalidRequest
from gateway.protocol import RewardAck, RewardRequest

router = APIRouter()


MAX_BATCH = 1000


def _targeted(body: RewardRequest, request: Request) -> RewardRequest:
    """Under /episodes/{id}/v1 a body that names no target rewards the path's episode."""
    if body.completion_id is None and body.episode_id is None:
        path_episode = request.path_params.get("episode_id")
        if path_episode is None:
            raise InvalidRequest("give one of completion_id or episode_id", param="episode_id")
        body = body.model_copy(update={"episode_id": path_episode})
    return body


@router.post("/v1/rewards", response_model=RewardAck | list[RewardAck])
async def post_reward(
    body: RewardRequest | list[RewardRequest], run: RunDep, request: Request
) -> RewardAck | list[RewardAck]:
    """One reward object, or a list of them stored all-or-nothing."""
    items = body if isinstance(body, list) else [body]
    if not 0 < len(items) <= MAX_BATCH:
        raise InvalidRequest(f"a batch holds 1 to {MAX_BATCH} rewards", param="body")
    acks = await request.app.state.rewards.post_many(run, [_targeted(b, request) for b in items])
    if any(a.episode_status == EpisodeStatus.REWARDED for a in acks):
        # a run with policies trains each policy's run (docs/policies.md)
        children = await request.app.state.policies.of(run.id) if declared_policies(run) else {}
        for run_id in [c.id for c in children.values()] or [run.id]:
            await request.app.state.scheduler.maybe_schedule(run_id)
    acks = await request.app.state.run_status.with_progress(run.id, acks)
    return acks if isinstance(body, list) else acks[0]
