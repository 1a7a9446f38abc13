"""The inference server killed under load: OpenAI-style 503s, then recovery when it returns.

The server is `inference.stub_server` (a stand-in speaking vLLM's HTTP API:
no GPU here), behind a run with `backend: vllm`. It is killed with SIGKILL
while agents stream and call, and started again on the same port.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from rlgate.stack import free_port, stop
from tests.faults.conftest import knob, pg_rows, wait_for
from tests.faults.load_agents import Received, run_agents, start_stub, warm_up

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _call(run: dict, stream: bool) -> httpx.Response:
    return httpx.post(
        run["base_url"] + "/chat/completions",
        headers={"Authorization": f"Bearer {run['api_key']}"},
        json={
            "model": run["name"],
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "stream": stream,
        },
        timeout=60,
    )


def test_backend_killed_gives_503_and_recovers(make_gateway, pg_database) -> None:
    _, db = pg_database
    port = free_port()
    stub = start_stub(port)
    try:
        gw = make_gateway(database_url=db)
        run = gw.create_run("backend-kill", backend="vllm", replicas=[f"http://127.0.0.1:{port}"])
        warm_up(run)
        got = Received()
        n = int(knob("backend_agents", 16))

        async def load_with_kill() -> list[httpx.Response]:
            load = asyncio.create_task(
                run_agents(run["base_url"], run["api_key"], run["name"], n, 300, True, got)
            )
            while len(got.completions) < 2 * n and not load.done():
                await asyncio.sleep(0.05)
            stub.kill()
            await asyncio.to_thread(stub.wait, 10)
            await asyncio.sleep(1)
            during = [await asyncio.to_thread(_call, run, s) for s in (False, True)]
            got.stop = True
            await load
            return during

        during = asyncio.run(load_with_kill())
        for resp in during:  # refused before a stream starts: a JSON error, retryable
            assert resp.status_code == 503, resp.text
            err = resp.json()["error"]
            assert err["type"] == "service_unavailable", err
            assert set(err) == {"message", "type", "param", "code"}
        statuses = {getattr(e, "status_code", None) for e in got.errors}
        assert 500 not in statuses and "unhandled error" not in gw.log_text()
        stub = start_stub(port)  # back on the same address: the gateway recovers by itself
        wait_for(lambda: _call(run, False).status_code == 200, 60, "recovery")
        assert _call(run, True).status_code == 200
    finally:
        stop(stub)
    stored = {r[0] for r in pg_rows(db, "SELECT id FROM completions")}
    assert got.completions <= stored


def test_backend_killed_mid_response_stream_ends_with_response_failed(
    make_gateway, pg_database
) -> None:
    """`/v1/responses` streaming: a backend that dies after tokens went out ends the stream
    with `response.failed` (not a crash), and nothing of the broken answer is stored."""
    _, db = pg_database
    port = free_port()
    stub = start_stub(port, tokens=12, token_latency_ms=250)  # ~3 s of streaming
    try:
        gw = make_gateway(database_url=db)
        run = gw.create_run("resp-kill", backend="vllm", replicas=[f"http://127.0.0.1:{port}"])
        warm_up(run)
        events: list[str] = []
        with httpx.stream(
            "POST",
            run["base_url"] + "/responses",
            headers={"Authorization": f"Bearer {run['api_key']}"},
            json={"model": run["name"], "input": "go", "max_output_tokens": 12, "stream": True},
            timeout=60,
        ) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("event: "):
                    events.append(line.removeprefix("event: "))
                    if events[-1] == "response.in_progress":
                        time.sleep(1.0)  # about 4 of the 12 tokens are sampled by now
                        stub.kill()
        assert events[-1] == "response.failed", events
        assert "response.completed" not in events
        assert pg_rows(db, "SELECT count(*) FROM completions")[0][0] == 1  # the warm-up only
        assert "unhandled error" not in gw.log_text()
    finally:
        stop(stub)
