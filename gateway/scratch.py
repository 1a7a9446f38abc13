"""A streaming answer that removes its scratch files however the client leaves.

A generator's `finally` runs only if the generator was started: a client that
hangs up before the first byte (Starlette then never iterates the body) left
the file behind. Here the removal runs when the response ends, whether it was
sent whole, cut mid-stream or never started, shielded from the cancellation
that a disconnect brings, and in a thread (a merged model is a whole directory).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class ScratchStreamingResponse(StreamingResponse):
    """`StreamingResponse` whose `cleanup` runs once the answer is over, in every case."""

    def __init__(self, content: Any, *, cleanup: Callable[[], None], **kwargs: Any) -> None:
        self.cleanup = cleanup
        try:
            super().__init__(content, **kwargs)
        except BaseException:
            cleanup()
            raise

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.cleanup)


def remover(path: str | Path) -> Callable[[], None]:
    """A cleanup that removes `path` (a file or a directory tree) if it is still there."""

    def remove() -> None:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    return remove
