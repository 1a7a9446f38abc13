"""Far more callers than the gateway's bound: quick 429s with Retry-After, never a 5xx.

A real gateway (PostgreSQL) in front of a slow stand-in vLLM server
(`inference.stub_server`, 300 ms a call), with a fixed bound of 4 sampling
calls in flight and 8 waiting. A burst of raw httpx callers (streaming and
not) far past that bound gets 200s and 429s only; every 429 carries the
OpenAI error body and a `retry-after-ms` the `openai` SDK honours; the
gateway's own high-water marks never pass the bound; every 200 is stored.
Then agents on the `openai` SDK with its retries on all finish: the SDK
waits as told and comes back.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from rlgate.stack import free_port, stop
from tests.faults.conftest import ADMIN_KEY, knob, pg_rows
from tests.faults.load_agents import start_stub, warm_up

pytestmark = [pytest.mark.integration, pytest.mark.slow]

INFLIGHT, QUEUE = 4, 8


def _overload_gauges(url: str) -> dict[str, float]:
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    text = httpx.get(url + "/metrics", headers=auth, timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith("rlgate_overload_") and 'scope="process"' in line:
            name, _, value = line.partition(" ")
            out[name.split("{")[0].removeprefix("rlgate_overload_")] = float(value)
    return out


async def _burst(run: dict, n: int) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(limits=limits, timeout=120) as http:

        async def one(i: int) -> httpx.Response:
            body = {
                "model": run["name"],
                "messages": [{"role": "user", "content": f"task {i}"}],
                "max_tokens": 4,
                "stream": i % 3 == 0,
            }
            headers = {"Authorization": f"Bearer {run['api_key']}"}
            resp = await http.post(
                run["base_url"] + "/chat/completions", json=body, headers=headers
            )
            await resp.aread()
            return resp

        return await asyncio.gather(*(one(i) for i in range(n)))


async def _sdk_agents(run: dict, n: int) -> list[str]:
    client = openai.AsyncOpenAI(
        base_url=run["base_url"], api_key=run["api_key"], max_retries=20, timeout=120
    )

    async def one(i: int) -> str:
        resp = await client.chat.completions.create(
            model=run["name"], messages=[{"role": "user", "content": f"sdk {i}"}], max_tokens=4
        )
        return resp.id

    return await asyncio.gather(*(one(i) for i in range(n)))


def test_overload_sheds_with_429_and_keeps_admitted_calls_whole(make_gateway, pg_database) -> None:
    _, db = pg_database
    port = free_port()
    stub = start_stub(port, latency_ms=300, tokens=4)
    try:
        gw = make_gateway(
            database_url=db,
            overload_max_inflight=INFLIGHT,
            overload_min_inflight=INFLIGHT,  # a fixed bound: the test counts against it
            overload_max_queue=QUEUE,
            overload_queue_timeout_s=30,
        )
        run = gw.create_run("overload", backend="vllm", replicas=[f"http://127.0.0.1:{port}"])
        warm_up(run)
        n = int(knob("overload_callers", 64))
        responses = asyncio.run(_burst(run, n))

        statuses = [r.status_code for r in responses]
        assert set(statuses) <= {200, 429}, statuses
        ok = [r for r in responses if r.status_code == 200]
        shed = [r for r in responses if r.status_code == 429]
        assert len(ok) >= INFLIGHT + QUEUE, statuses  # the bound's worth is always served
        assert shed, "a burst far past the bound must be shed"
        sdk = openai.OpenAI(api_key="unused")
        for r in shed:
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, err
            assert (err["type"], err["code"]) == ("rate_limit_error", "overloaded"), err
            assert int(r.headers["retry-after"]) >= 1
            # what the SDK itself reads off the answer: a wait it honours (0 < s <= 60)
            wait = sdk._parse_retry_after_header(r.headers)
            assert wait is not None and 0 < wait <= 60, r.headers
        gauges = _overload_gauges(gw.url)
        assert gauges["inflight_peak"] <= INFLIGHT and gauges["queue_peak"] <= QUEUE, gauges
        assert gauges["queue_peak"] == QUEUE  # the queue was used to its bound, not past it

        # the openai SDK's own retries wait as told and get every call through
        ids = asyncio.run(_sdk_agents(run, int(knob("overload_sdk_agents", 24))))
        gauges = _overload_gauges(gw.url)
        assert gauges["inflight_peak"] <= INFLIGHT and gauges["queue_peak"] <= QUEUE, gauges
    finally:
        stop(stub)
    stored = {r[0] for r in pg_rows(db, "SELECT id FROM completions")}
    answered = {r.json()["id"] for r in ok if not r.headers["content-type"].startswith("text/")}
    streamed = [r for r in ok if r.headers["content-type"].startswith("text/event-stream")]
    assert answered <= stored and set(ids) <= stored
    # streamed answers are stored too: every chunk names the completion
    for r in streamed:
        first = next(line for line in r.text.splitlines() if line.startswith("data: {"))
        assert httpx.Response(200, content=first.removeprefix("data: ")).json()["id"] in stored
    assert len(stored) == 1 + len(ok) + len(ids)  # the warm-up, the 200s, the SDK's: no more
    assert "unhandled error" not in gw.log_text()
