"""PostgreSQL briefly unreachable: clean 503s, nothing half-written, service resumes.

The shared PostgreSQL is never stopped: the gateway reaches it through a TCP
proxy (tests/faults/tcp_proxy.py) that the test cuts for a few seconds.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from rlgate.stack import free_port, stop
from tests.faults.conftest import knob, pg_rows, wait_for
from tests.faults.load_agents import Received, run_agents, start_stub, warm_up
from tests.faults.tcp_proxy import TcpProxy

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _chat(run: dict, stream: bool = False) -> httpx.Response:
    return httpx.post(
        run["base_url"] + "/chat/completions",
        headers={"Authorization": f"Bearer {run['api_key']}"},
        json={
            "model": run["name"],
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4,
            "stream": stream,
        },
        timeout=60,
    )


def test_cut_database_gives_503_and_resumes(make_gateway, pg_database) -> None:
    name, direct = pg_database
    proxy = TcpProxy("127.0.0.1", 5432, free_port()).start()
    try:
        gw = make_gateway(database_url=f"postgresql://postgres@127.0.0.1:{proxy.port}/{name}")
        run = gw.create_run("pg-outage")
        warm_up(run)
        got = Received()
        n, outage_s = int(knob("pg_agents", 8)), knob("pg_outage_s", 4)

        async def load_with_cut() -> list[httpx.Response]:
            load = asyncio.create_task(
                run_agents(run["base_url"], run["api_key"], run["name"], n, 300, False, got)
            )
            await asyncio.sleep(2)
            await asyncio.to_thread(proxy.cut)
            await asyncio.sleep(0.5)
            during = [await asyncio.to_thread(_chat, run, s) for s in (False, True)]
            await asyncio.sleep(outage_s)
            await asyncio.to_thread(proxy.reopen)
            await asyncio.sleep(3)
            got.stop = True
            await load
            return during

        during = asyncio.run(load_with_cut())
        for resp in during:  # a plain call and a streaming one, both refused before any work
            assert resp.status_code == 503, resp.text
            err = resp.json()["error"]
            assert err["type"] == "service_unavailable" and err["code"] == "database_unavailable"
            assert set(err) == {"message", "type", "param", "code"}
        statuses = [getattr(e, "status_code", None) for e in got.errors]
        assert 500 not in statuses, "a database outage must never be a 500"
        assert 503 in statuses, "the agents' calls during the cut must have been refused"
        assert "unhandled error" not in gw.log_text()
        # service resumes without a restart
        wait_for(lambda: _chat(run).status_code == 200, 20, "the gateway to serve again")
        assert _chat(run, stream=True).status_code == 200
    finally:
        proxy.close()
    stored = {r[0] for r in pg_rows(direct, "SELECT id FROM completions")}
    assert got.completions <= stored, "a completion a client received is not stored"
    assert got.rewards <= {r[0] for r in pg_rows(direct, "SELECT idempotency_key FROM rewards")}
    orphans = pg_rows(
        direct,
        "SELECT count(*) FROM episodes e WHERE NOT EXISTS "
        "(SELECT 1 FROM completions c WHERE c.run_id = e.run_id AND c.episode_id = e.id)",
    )
    assert orphans[0][0] == 0, "an episode was written without its completions"


def test_database_cut_mid_stream_ends_it_with_an_error_event(make_gateway, pg_database) -> None:
    """Tokens already went out with status 200: the stream ends with OpenAI's error event."""
    name, direct = pg_database
    proxy = TcpProxy("127.0.0.1", 5432, free_port()).start()
    stub_port = free_port()
    stub = start_stub(stub_port, tokens=12, token_latency_ms=250)  # ~3 s of streaming
    try:
        gw = make_gateway(database_url=f"postgresql://postgres@127.0.0.1:{proxy.port}/{name}")
        run = gw.create_run(
            "mid-stream", backend="vllm", replicas=[f"http://127.0.0.1:{stub_port}"]
        )
        warm_up(run)
        events = []
        with httpx.stream(
            "POST",
            run["base_url"] + "/chat/completions",
            headers={"Authorization": f"Bearer {run['api_key']}"},
            json={
                "model": run["name"],
                "messages": [{"role": "user", "content": "go"}],
                "max_tokens": 12,
                "stream": True,
            },
            timeout=60,
        ) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line.removeprefix("data: "))
                if len(events) == 2:
                    proxy.cut()  # the answer is being sampled; the database goes away
        assert events[-1] != "[DONE]", "a stream whose completion was not stored must not end well"
        err = json.loads(events[-1])["error"]
        assert err["type"] == "service_unavailable" and err["code"] == "database_unavailable"
        # only the warm-up call is stored: nothing of the cut stream was half-written
        assert pg_rows(direct, "SELECT count(*) FROM completions")[0][0] == 1
        assert pg_rows(direct, "SELECT count(*) FROM episodes")[0][0] == 1
        proxy.reopen()
        wait_for(lambda: _chat(run).status_code == 200, 20, "the gateway to serve again")
        assert "unhandled error" not in gw.log_text()
    finally:
        stop(stub)
        proxy.close()
