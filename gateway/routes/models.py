"""GET /v1/models: what a run key serves: its run's name, or each of its policies."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.agent.policies import declared_policies
from gateway.deps import RunDep
from gateway.protocol import ModelCard, ModelList

router = APIRouter()


@router.get("/v1/models", response_model=ModelList)
async def list_models(run: RunDep) -> ModelList:
    """`<run name>/<policy>` for each declared policy (docs/policies.md), else the run's name."""
    created = int(run.created_at.timestamp())
    names = [f"{run.name}/{p}" for p in declared_policies(run)] or [run.name]
    return ModelList(data=[ModelCard(id=name, created=created) for name in names])
