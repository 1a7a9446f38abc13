"""Admin API: a run's held-out (evaluation) figures, one row per version."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.deps import AdminDep

router = APIRouter(prefix="/admin/v1", dependencies=[AdminDep], tags=["admin"])
