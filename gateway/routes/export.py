"""Admin export (admin credential): a run's episodes as JSON lines or a Parquet file."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from core.store.status import EpisodeStatus
from gateway.admin.export import (
    JSONL_MEDIA_TYPE,
    PARQUET_MEDIA_TYPE,
    ExportFilter,
    ExportFormat,
    ExportService,
    ExportSplit,
)
from gateway.deps import AdminDep
from gateway.scratch import ScratchStreamingResponse, remover

router = APIRouter(prefix="/admin/v1", dependencies=[AdminDep], tags=["admin"])

CHUNK_BYTES = 1 << 20


@router.get(
    "/runs/{run_id}/export",
    response_class=StreamingResponse,
    responses={200: {"content": {JSONL_MEDIA_TYPE: {}, PARQUET_MEDIA_TYPE: {}}}},
)
async def export_run(
    run_id: str,
    request: Request,
    fmt: Annotated[ExportFormat, Query(alias="format")] = "jsonl",
    status: Annotated[EpisodeStatus | None, Query()] = None,
    # versions are 32-bit integers in the store: a larger bound is a 400, not a driver error
    min_version: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
    # train: every training episode, no evaluation one; eval: only the evaluation episodes
    split: Annotated[ExportSplit, Query()] = "train",
) -> StreamingResponse:
    """One record per episode of the split, oldest first; see docs/export.md for the schema."""
    await request.app.state.runs.get(run_id)  # a 404 must come before the first byte
    service = ExportService(request.app.state.sessions)
    filt = ExportFilter(status=status, min_version=min_version, split=split)
    name = run_id if split == "train" else f"{run_id}-eval"
    if fmt == "jsonl":
        return StreamingResponse(
            service.jsonl(run_id, filt),
            media_type=JSONL_MEDIA_TYPE,
            headers={"Content-Disposition": f'attachment; filename="{name}.jsonl"'},
        )
    # Parquet's footer comes last, so the file is built whole before the answer starts;
    # it is removed when the answer ends, even if the client left before its first byte.
    path = await service.parquet_file(run_id, filt)
    return ScratchStreamingResponse(
        _read(path),
        cleanup=remover(path),
        media_type=PARQUET_MEDIA_TYPE,
        headers={
            "Content-Disposition": f'attachment; filename="{name}.parquet"',
            "Content-Length": str(os.path.getsize(path)),
        },
    )


async def _read(path: str) -> AsyncIterator[bytes]:
    with open(path, "rb") as f:
        while chunk := await asyncio.to_thread(f.read, CHUNK_BYTES):
            yield chunk
