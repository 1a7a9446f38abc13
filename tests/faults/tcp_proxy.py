"""A TCP proxy that a test can cut and reopen: a database outage without stopping the database.

Runs its own asyncio loop in a daemon thread. `cut()` closes the listening
socket and every open connection (clients see resets, new connects are
refused); `reopen()` listens again on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

logger = logging.getLogger(__name__)


class TcpProxy:
    def __init__(self, target_host: str, target_port: int, port: int) -> None:
        self.target = (target_host, target_port)
        self.port = port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.connections = 0  # accepted since start (the test can see traffic went through)

    def start(self) -> TcpProxy:
        self._thread.start()
        self.reopen()
        return self

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    def reopen(self) -> None:
        self._call(self._listen())

    def cut(self) -> None:
        self._call(self._cut())

    def close(self) -> None:
        self.cut()
        self._call(self._drain())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _drain(self) -> None:
        """Let the cut connections' handlers end, so the loop stops with no task pending."""
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    async def _listen(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(
                self._handle, "127.0.0.1", self.port, reuse_address=True
            )

    async def _cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers.discard(writer)
        self._writers.discard(up_writer)
