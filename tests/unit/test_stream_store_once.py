"""A streaming client that goes away while its completion waits for the group commit: the row
is handed to the writer once (the writer commits it anyway), never a second time as a partial
(the duplicate failed its whole batch)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from gateway.agent.streaming import SampleStream
from inference.types import GenerateResult


class _Stream:
    """A finished generation of two tokens."""

    def __init__(self) -> None:
        self.cancelled = False

    async def tokens(self):
        for t in (5, 6):
            yield t, -0.5

    def cancel(self) -> None:
        self.cancelled = True

    async def result(self) -> GenerateResult:
        return GenerateResult([5, 6], [-0.5, -0.5], "stop", 0)


class _Chat:
    """Records every store; the first one waits for a commit that never comes in time."""

    def __init__(self) -> None:
        self.stores: list[Any] = []
        self.waiting = asyncio.Event()

    def completion_row(self, prep, completion_id, choice, result):
        return SimpleNamespace(
            id=completion_id, finish_reason=result.finish_reason, tool_calls=None
        )

    async def store(self, rows, group_id, *, evaluation: bool = False) -> None:
        self.stores.append(rows)
        if len(self.stores) == 1:
            self.waiting.set()
            await asyncio.sleep(3600)  # the commit in flight


def _prep() -> SimpleNamespace:
    backend = SimpleNamespace(start_stream=lambda request: _Stream())
    return SimpleNamespace(
        serving=SimpleNamespace(
            backend=backend,
            template=SimpleNamespace(decode=lambda ids: "x" * len(ids)),
            start_on=None,
        ),
        prompt_ids=[1, 2],
        params=SimpleNamespace(stop=()),
        placement=SimpleNamespace(episode_id="ep-1", group_id=None, evaluation=False),
        reasoning=False,
        think_open=False,
        tool_parser=None,
    )


def test_a_client_gone_during_the_final_store_stores_once() -> None:
    async def go() -> list:
        chat = _Chat()
        stream = SampleStream(chat, _prep(), "cmpl-1")
        await stream.open()

        async def consume() -> None:
            async for _ in stream.events():
                pass

        task = asyncio.create_task(consume())
        await chat.waiting.wait()
        task.cancel()  # the client disconnects while the row waits for its commit
        await asyncio.gather(task, return_exceptions=True)
        return chat.stores

    assert len(asyncio.run(go())) == 1
