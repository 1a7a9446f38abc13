"""Liveness: answers 200 once the app has started and the store is reachable."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import text

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    try:
        async with request.app.state.sessions() as s:
            await s.execute(text("SELECT 1"))
    except Exception:
        return JSONResponse({"status": "unavailable", "database": False}, status_code=503)
    return JSONResponse({"status": "ok", "database": True})
