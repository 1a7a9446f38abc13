"""Admin API: a run's held-out (evaluation) figures, one row per version."""

from __future__ import annotations

from fastapi import APIRouter, Request

from gateway.deps import AdminDep
from gateway.protocol_admin import EvalFiguresList

router = APIRouter(prefix="/admin/v1", dependencies=[AdminDep], tags=["admin"])


@router.get("/runs/{run_id}/evals", response_model=EvalFiguresList)
async def run_evals(run_id: str, request: Request) -> EvalFiguresList:
    """Per version: scored evaluation episodes, mean reward, standard error; spanning apart."""
    return await request.app.state.eval_admin.figures(run_id)
