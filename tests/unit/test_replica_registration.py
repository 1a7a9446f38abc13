"""A server registered or removed while its run is being loaded (the gateway's BackendPool).

The load reads the run's servers from the store, then spends a while joining them
(templates, the servers' context, the swap barrier); a registration or a removal
that lands in that while is stored first and then told to the pool. Each case
holds the load inside its `join` (an injected `ServerSwaps`) until the change is
in, and checks the set the run is served by: a removed server is not in it, and
a registered one is. Real stand-in servers (`inference.stub_server`, vLLM's API;
no GPU here) on loopback; the store is a list the pool's read returns.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from gateway.control.backends import BackendPool, RunServing, ServedWeights
from inference.swap import SharedReplicas, SoleServerSwaps, Swapper, WeightsSource
from inference.types import GenerateRequest, SamplingParams
from rlgate.stack import free_port, stop
from tests.faults.load_agents import start_stub

RUN = "run-1"


class HeldJoin(SoleServerSwaps):
    """Joins the run's servers only once `release` is set."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def join(
        self, run_id: str, replicas: SharedReplicas, source: WeightsSource | None, version: int
    ) -> Swapper:
        self.entered.set()
        await self.release.wait()
        return await super().join(run_id, replicas, source, version)


class Registered(BackendPool):
    """The pool with the store's replica rows as a list."""

    def __init__(self, urls: list[str], swaps: HeldJoin) -> None:
        super().__init__(swaps=swaps)
        self.urls = urls

    async def replica_urls(self, run_id: str) -> list[str]:
        return list(self.urls)

    async def register(self, url: str) -> None:
        """What the admin API does: store the registration, then tell the pool."""
        self.urls.append(url)
        await self.add_replica(RUN, "vllm", url)

    async def remove(self, url: str) -> None:
        """Store the removal, then tell the pool."""
        self.urls.remove(url)
        await self.remove_replica(RUN, url)


@pytest.fixture(scope="module")
def servers() -> Iterator[list[str]]:
    ports = [free_port(), free_port()]
    procs = [start_stub(port) for port in ports]
    try:
        yield [f"http://127.0.0.1:{port}" for port in ports]
    finally:
        for proc in procs:
            stop(proc)


def _served_by(serving: RunServing) -> set[str]:
    assert serving.replicas is not None
    return {r["name"] for r in serving.replicas.replica_status()}


@contextlib.asynccontextmanager
async def loaded_during(
    urls: list[str], model: Path, change: Callable[[Registered], Awaitable[None]]
) -> AsyncIterator[tuple[Registered, RunServing]]:
    """A pool serving `urls` loads the run; once the load is inside its join, `change` starts
    and runs as far as it can; then the load finishes, and `change` after it."""
    swaps = HeldJoin()
    pool = Registered(list(urls), swaps)
    try:
        load = asyncio.create_task(pool.get(RUN, ServedWeights(model, "vllm", 0, None)))
        await swaps.entered.wait()
        task = asyncio.create_task(change(pool))
        for _ in range(20):
            await asyncio.sleep(0)
        swaps.release.set()
        serving = await load
        await task
        yield pool, serving
    finally:
        await pool.close()


async def test_a_server_removed_during_the_load_is_not_served(
    servers: list[str], tiny_model_dir: Path
) -> None:
    async with loaded_during(servers, tiny_model_dir, lambda pool: pool.remove(servers[0])) as (
        pool,
        serving,
    ):
        assert _served_by(serving) == {servers[1]}
        assert pool.loaded()[RUN] is serving


async def test_the_last_server_removed_during_the_load_unloads_the_run(
    servers: list[str], tiny_model_dir: Path
) -> None:
    async with loaded_during(servers[:1], tiny_model_dir, lambda pool: pool.remove(servers[0])) as (
        pool,
        _,
    ):
        assert RUN not in pool.loaded()  # the next call loads again, and finds no server


async def test_a_server_registered_during_the_load_is_served(
    servers: list[str], tiny_model_dir: Path
) -> None:
    async with loaded_during(
        servers[:1], tiny_model_dir, lambda pool: pool.register(servers[1])
    ) as (pool, serving):
        assert _served_by(serving) == set(servers)
        await pool.add_replica(RUN, "vllm", servers[1])  # one the load read: not added twice
        assert _served_by(serving) == set(servers)
        assert serving.replicas is not None and len(serving.replicas.replica_status()) == 2
        result = await serving.backend.generate(GenerateRequest([1, 2, 3], SamplingParams()))
        assert result.output_token_ids
