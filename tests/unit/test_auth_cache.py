"""RunKeyCache: what is cached, for how long, and that a racing read cannot undo an invalidation."""

from __future__ import annotations

import time

from core.store.models import Run
from gateway.middleware.auth_cache import RunKeyCache


def _run(name: str = "r") -> Run:
    return Run(id="run_" + name, name=name, model="tiny", model_path="/x", config={})


def test_hit_within_ttl_and_miss_after() -> None:
    cache = RunKeyCache(ttl_s=0.2)
    run = _run()
    cache.put("h", run, cache.generation)
    assert cache.get("h") is run
    time.sleep(0.25)
    assert cache.get("h") is None


def test_a_read_that_began_before_an_invalidation_is_not_cached() -> None:
    cache = RunKeyCache(ttl_s=10)
    generation = cache.generation  # a lookup starts ...
    cache.invalidate()  # ... an admin write lands meanwhile ...
    cache.put("h", _run(), generation)  # ... the lookup's (old) answer is dropped
    assert cache.get("h") is None
    cache.put("h", _run(), cache.generation)
    assert cache.get("h") is not None
    cache.invalidate()
    assert cache.get("h") is None


def test_ttl_zero_caches_nothing_and_size_is_bounded() -> None:
    off = RunKeyCache(ttl_s=0)
    off.put("h", _run(), off.generation)
    assert off.get("h") is None
    small = RunKeyCache(ttl_s=10, max_entries=2)
    for i in range(3):
        small.put(f"h{i}", _run(str(i)), small.generation)
    assert small.get("h2") is not None and len(small._entries) <= 2


async def test_concurrent_misses_share_one_lookup_and_nobody_joins_one_older_than_a_write() -> None:
    import asyncio

    cache = RunKeyCache(ttl_s=10)
    calls = 0
    release = asyncio.Event()

    async def load() -> Run:
        nonlocal calls
        calls += 1
        mine = calls
        await release.wait()
        return _run(str(mine))

    async def settle() -> None:  # every task runs up to its first real wait
        for _ in range(5):
            await asyncio.sleep(0)

    first = [asyncio.create_task(cache.get_or_load("h", load)) for _ in range(10)]
    await settle()
    assert calls == 1  # ten misses, one read of the store
    cache.invalidate()  # an admin write lands while that read is in flight
    late = asyncio.create_task(cache.get_or_load("h", load))
    await settle()
    assert calls == 2  # the late caller reads again: it must see the write
    release.set()
    assert {(await t).name for t in first} == {"1"}
    assert (await late).name == "2"
    assert cache.get("h").name == "2"  # the read from before the write was not cached


async def test_an_unknown_key_is_looked_up_every_time() -> None:
    cache = RunKeyCache(ttl_s=10)
    calls = 0

    async def load() -> None:
        nonlocal calls
        calls += 1

    assert await cache.get_or_load("h", load) is None
    assert await cache.get_or_load("h", load) is None
    assert calls == 2
