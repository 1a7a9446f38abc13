"""One inference backend and chat template per run, loaded lazily off the event loop."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from inference.backend import Backend
from inference.chat_template import ChatTemplate
from inference.local import LocalBackend

logger = logging.getLogger(__name__)


@dataclass
class RunServing:
    backend: Backend
    template: ChatTemplate
    max_context: int


class BackendPool:
    """Owns every backend of this gateway. `get` loads the run's model on first use."""

    def __init__(self, max_batch_size: int = 32) -> None:
        self.max_batch_size = max_batch_size
        self._serving: dict[str, RunServing] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def loaded(self) -> dict[str, RunServing]:
        return dict(self._serving)

    async def get(
        self, run_id: str, model_dir: Path, backend: str, version: int, ckpt: Path | None
    ) -> RunServing:
        if run_id in self._serving:
            return self._serving[run_id]
        lock = self._locks.setdefault(run_id, asyncio.Lock())
        async with lock:
            if run_id not in self._serving:
                self._serving[run_id] = await asyncio.to_thread(
                    self._load, model_dir, backend, version, ckpt
                )
        return self._serving[run_id]

    def _load(self, model_dir: Path, backend: str, version: int, ckpt: Path | None) -> RunServing:
        if backend != "local":
            raise ValueError(f"backend {backend!r} is not available in this gateway")
        # Serve the newest checkpoint directly, so a restarted gateway resumes at its version.
        source = ckpt if ckpt is not None else model_dir
        if not source.is_dir():
            raise OSError(f"checkpoint {source} of version {version} is missing")
        template = ChatTemplate(model_dir)
        be = LocalBackend(
            source, version=version, max_batch_size=self.max_batch_size, decode=template.decode
        )
        logger.info("loaded %s (version %d) for serving", source, version)
        return RunServing(be, template, be.max_context)

    async def unload(self, run_id: str) -> None:
        serving = self._serving.pop(run_id, None)
        if serving is not None:
            await serving.backend.close()

    async def close(self) -> None:
        for run_id in list(self._serving):
            await self.unload(run_id)
