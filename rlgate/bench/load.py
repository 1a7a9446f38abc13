"""Closed-loop HTTP load for `rlgate bench gateway`: asyncio + httpx, or `wrk` when present.

Both loaders give one result shape per load: ``requests`` (2xx answers; only
those are throughput), ``rps`` (2xx per second), ``status_429``,
``status_5xx``, ``errors`` (every answer that is not 2xx, and transport
errors) and the p50/p90/p99 latencies, all counted after a warm-up whose 2xx
answers are ``warm_2xx`` (512 clients that start at once answer in rounds at
first; that transient is not the sustained rate). A path may hold ``{n}``:
each request gets its own value there (a fresh episode per request).
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

Target = tuple[str, str, dict, dict]  # base URL, path, body, headers
T = TypeVar("T")


async def _one(client: Any, url: str, body: dict, headers: dict) -> tuple[int, float]:
    """(HTTP status, seconds); a 2xx must carry choices or end its stream with [DONE]."""
    t0 = time.perf_counter()
    if not body.get("stream"):
        resp = await client.post(url, json=body, headers=headers)
        if resp.is_success and not resp.json().get("choices"):
            raise RuntimeError(f"no choices from {url}")
    else:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            done = False
            async for line in resp.aiter_lines():
                done = done or line.strip() == "data: [DONE]"
            if resp.is_success and not done:
                raise RuntimeError(f"stream from {url} ended without [DONE]")
    return resp.status_code, time.perf_counter() - t0


async def _load(target: Target, concurrency: int, seconds: float, warmup: float) -> dict[str, Any]:
    """`concurrency` clients, each sending its next request when one ends."""
    import httpx

    base, path, body, headers = target
    prefix = secrets.token_hex(4)
    counter = itertools.count()
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    failures = warm_ok = 0

    def url() -> str:
        return base + path.replace("{n}", f"{prefix}-{next(counter)}")

    # keepalive_expiry under uvicorn's 5 s: never reuse a connection the server is closing
    limits = httpx.Limits(
        max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=2.0
    )
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:
        measured_from = time.perf_counter() + warmup
        deadline = measured_from + seconds

        async def worker() -> None:
            nonlocal failures, warm_ok
            while time.perf_counter() < deadline:
                try:
                    status, latency = await _one(client, url(), body, headers)
                except (httpx.HTTPError, RuntimeError, ValueError):
                    failures += time.perf_counter() >= measured_from
                    continue
                if time.perf_counter() < measured_from:
                    warm_ok += 200 <= status < 300
                    continue
                statuses[status] = statuses.get(status, 0) + 1
                latencies.append(latency)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - measured_from
    ok = sum(n for s, n in statuses.items() if 200 <= s < 300)
    q = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else [0.0] * 99
    return {
        "concurrency": concurrency,
        "requests": ok,
        "answers": len(latencies),
        "errors": len(latencies) - ok + failures,
        "status_429": statuses.get(429, 0),
        "status_5xx": sum(n for s, n in statuses.items() if s >= 500),
        "statuses": {str(s): n for s, n in sorted(statuses.items())},
        "rps": round(ok / elapsed, 1),
        "p50_ms": round(q[49] * 1000, 2),
        "p90_ms": round(q[89] * 1000, 2),
        "p99_ms": round(q[98] * 1000, 2),
        "warm_2xx": warm_ok,
    }


def warm(target: Target) -> int:
    """One request (connections, lazy loading); the number of 2xx answers (0 or 1)."""

    async def once() -> int:
        import httpx

        base, path, body, headers = target
        url = base + path.replace("{n}", "warm-" + secrets.token_hex(4))
        async with httpx.AsyncClient(timeout=60) as client:
            status, _ = await _one(client, url, body, headers)
        return int(200 <= status < 300)

    return asyncio.run(once())


def load(
    target: Target, concurrency: int, seconds: float, loader: str, warmup: float = 1.0
) -> dict[str, Any]:
    """One closed-loop load with `loader` ("wrk" or "python"): one request, `warmup`, `seconds`.

    `warmup` is whole seconds with wrk. `warm_ok`: the first request's 2xx (0 or 1).
    """
    warmed = warm(target)
    if loader == "wrk":
        from rlgate.bench.wrk import wrk_load

        base, path, body, headers = target
        out = wrk_load(base, path, body, headers, concurrency, seconds, warmup)
    else:
        out = asyncio.run(_load(target, concurrency, seconds, warmup))
    return {**out, "warm_ok": warmed}


SUMMED = ("requests", "answers", "errors", "status_429", "status_5xx", "warm_2xx", "warm_ok")
MEDIAN = ("rps", "p50_ms", "p90_ms", "p99_ms")


def combine_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One level's loads over several rounds as one load: counts summed, rates and
    percentiles the rounds' medians, each round's own figures kept under ``rounds``."""
    out = dict(rounds[0])
    for key in SUMMED:
        out[key] = sum(r.get(key, 0) for r in rounds)
    for key in MEDIAN:
        out[key] = statistics.median(r[key] for r in rounds)
    statuses = sum((Counter(r.get("statuses", {})) for r in rounds), Counter())
    out["statuses"] = dict(sorted(statuses.items()))
    if len(rounds) > 1:
        out["rounds"] = [{k: r[k] for k in ("rps", "p50_ms", "p99_ms")} for r in rounds]
    return out


def alternating(items: list[T], times: int) -> list[list[T]]:
    """`items` `times` times: as given, then reversed, alternately. The levels' order in
    each round, so that a machine whose speed drifts (or a store that grows) weighs on
    every level alike; the targets' order in each load, so that of any two targets each
    goes first in every other load."""
    return [list(items) if i % 2 == 0 else list(reversed(items)) for i in range(times)]


def _figures(samples: list[list[dict[str, Any]]]) -> dict[str, Any]:
    latency, *loads = (combine_rounds(s) for s in samples)
    best = max(loads, key=lambda m: m["rps"])
    return {"latency": latency, "throughput": loads, "max_rps": best["rps"]}


def measure_together(
    targets: dict[str, Target],
    latency_c: int,
    levels: list[int],
    seconds: float,
    loader: str,
    settle: Callable[[], None] = lambda: None,
    warmup: float = 1.0,
    rounds: int = 1,
    run_load: Callable[..., dict[str, Any]] = load,
) -> dict[str, dict[str, Any]]:
    """Latency at `latency_c` clients and 2xx throughput at each level of every target
    (`max_rps` its best), the targets up at once and loaded in lockstep.

    Each load (the latency load, then every level, round by round in `alternating`
    order, the latency load first in the first round) runs on every target back to
    back before the next load starts, the targets' order reversed from one load to
    the next. Two targets compared by a ratio are then loaded seconds apart, each
    first as often as the other: a machine whose speed drifts over minutes, or a
    store still writing what the last target sent it, weighs on both alike. Measured
    one after the other, minutes apart, the same two gateways' max req/s ratio moved
    by 0.4 with their order on a 2-core VM.

    With `rounds` > 1 a load's figures are the rounds' medians (`combine_rounds`): the
    best level and the others are then read the same way, not one load against the
    best of several, and the added latency is not one 5-second load's (which moved by
    2-3 ms at 4 clients between two runs of the same gateway on this machine).
    `settle` runs before each load: what an overloaded target still holds from the
    last one must not be measured with the next. `run_load`: `load`'s stand-in in tests.
    """
    names = list(targets)
    concurrencies = [latency_c, *levels]  # position 0: the latency load
    slots = [
        i for order in alternating(list(range(len(concurrencies))), max(1, rounds)) for i in order
    ]
    samples = {name: [[] for _ in concurrencies] for name in names}
    for i, order in zip(slots, alternating(names, len(slots)), strict=True):
        for name in order:
            settle()
            samples[name][i].append(
                run_load(targets[name], concurrencies[i], seconds, loader, warmup)
            )
    return {name: _figures(s) for name, s in samples.items()}
