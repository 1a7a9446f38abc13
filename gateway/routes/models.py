"""GET /v1/models: the one model a run key serves, its run's name."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.deps import RunDep
from gateway.protocol import ModelCard, ModelList

router = APIRouter()


@router.get("/v1/models", response_model=ModelList)
async def list_models(run: RunDep) -> ModelList:
    return ModelList(data=[ModelCard(id=run.name, created=int(run.created_at.timestamp()))])
