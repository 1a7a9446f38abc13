"""One error contract: every agent endpoint, streaming or not, fails the same way.

Walks {chat, text completions, Responses, Messages} x {plain, stream} x
{backend overloaded, backend unreachable, database down} against one real
gateway on PostgreSQL:

- overloaded: a run whose only server (`inference.stub_server`, a stand-in
  speaking vLLM's API: no GPU here) answers every request 429; the gateway
  answers 429 with a `Retry-After` that the openai and anthropic SDKs honour;
- unreachable: a run whose only server was killed: 503 `backend_unavailable`;
- database down: the gateway reaches PostgreSQL through a TCP proxy
  (tests/faults/tcp_proxy.py) that the test cuts: 503 `database_unavailable`.

A stream fails before its first byte, so its status is the plain call's.
The body is OpenAI's `{"error": {...}}`, and Anthropic's `{"type": "error",
"error": {...}}` under `/v1/messages`. Nothing is stored for a failed call.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from rlgate.stack import free_port, stop
from tests.faults.conftest import PG_ADMIN, Gateway, fault_settings, pg_rows
from tests.faults.load_agents import start_stub
from tests.faults.tcp_proxy import TcpProxy

pytestmark = [pytest.mark.integration, pytest.mark.slow]

USER = [{"role": "user", "content": "hi"}]
ENDPOINTS = {
    "chat": ("/chat/completions", {"messages": USER, "max_tokens": 4}),
    "completions": ("/completions", {"prompt": "hi", "max_tokens": 4}),
    "responses": ("/responses", {"input": "hi", "max_output_tokens": 4}),
    "messages": ("/messages", {"messages": USER, "max_tokens": 4}),
}
# condition -> (status, OpenAI type and code, Anthropic type)
EXPECTED = {
    "overloaded": (429, "rate_limit_error", "backend_overloaded", "rate_limit_error"),
    "unreachable": (503, "service_unavailable", "backend_unavailable", "api_error"),
    "database_down": (503, "service_unavailable", "database_unavailable", "api_error"),
}


@dataclass
class Contract:
    gateway: Gateway
    proxy: TcpProxy
    db: str
    runs: dict[str, dict]  # condition -> run

    def call(self, condition: str, endpoint: str, stream: bool) -> httpx.Response:
        run = self.runs[condition]
        path, body = ENDPOINTS[endpoint]
        # Each SDK's own way to present the key.
        auth = (
            {"x-api-key": run["api_key"], "anthropic-version": "2023-06-01"}
            if endpoint == "messages"
            else {"Authorization": f"Bearer {run['api_key']}"}
        )
        with httpx.stream(
            "POST",
            run["base_url"] + path,
            headers=auth,
            json={"model": run["name"], "stream": stream, **body},
            timeout=60,
        ) as resp:
            resp.read()
        return resp


@pytest.fixture(scope="module")
def contract(tmp_path_factory, model_cache_dir: Path, tiny_model_dir: Path) -> Iterator[Contract]:
    tmp = tmp_path_factory.mktemp("contract")
    name = "rlgate_contract_" + uuid.uuid4().hex[:10]
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    busy_port, dead_port = free_port(), free_port()
    busy = start_stub(busy_port, 20, 8, 0, "--max-running", "0")
    dead = start_stub(dead_port)
    proxy = TcpProxy("127.0.0.1", 5432, free_port()).start()
    gw = Gateway(
        fault_settings(
            tmp,
            model_cache_dir,
            database_url=f"postgresql://postgres@127.0.0.1:{proxy.port}/{name}",
        ),
        tmp / "gateway.log",
    )
    try:
        gw.start()
        runs = {
            "overloaded": gw.create_run(
                "busy", backend="vllm", replicas=[f"http://127.0.0.1:{busy_port}"]
            ),
            "unreachable": gw.create_run(
                "dead", backend="vllm", replicas=[f"http://127.0.0.1:{dead_port}"]
            ),
            "database_down": gw.create_run("local"),
        }
        stop(dead)  # the run outlives its server
        yield Contract(gw, proxy, f"postgresql://postgres@127.0.0.1:5432/{name}", runs)
    finally:
        gw.stop()
        proxy.close()
        for proc in (busy, dead):
            stop(proc)
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _check(resp: httpx.Response, condition: str, endpoint: str) -> None:
    status, kind, code, anthropic_kind = EXPECTED[condition]
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json"), resp.headers
    body: dict[str, Any] = resp.json()
    if endpoint == "messages":
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        assert body["error"]["type"] == anthropic_kind, body
    else:
        assert (body["error"]["type"], body["error"]["code"]) == (kind, code), body
    if status == 429:
        assert int(resp.headers["retry-after"]) >= 1  # both SDKs wait on it (up to 60 s)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
@pytest.mark.parametrize("condition", ["overloaded", "unreachable"])
def test_backend_failures(contract: Contract, condition: str, endpoint: str, stream: bool) -> None:
    _check(contract.call(condition, endpoint, stream), condition, endpoint)
    run_id = contract.runs[condition]["run_id"]
    stored = pg_rows(contract.db, "SELECT COUNT(*) FROM completions WHERE run_id = %s", (run_id,))
    assert stored == [(0,)]


def test_database_down(contract: Contract) -> None:
    # Warm first: the key is cached and the model loaded, so the store is what fails.
    for endpoint in ENDPOINTS:
        assert contract.call("database_down", endpoint, False).status_code == 200
    before = pg_rows(contract.db, "SELECT COUNT(*) FROM completions")
    contract.proxy.cut()
    try:
        for endpoint in ENDPOINTS:
            for stream in (False, True):
                _check(contract.call("database_down", endpoint, stream), "database_down", endpoint)
    finally:
        contract.proxy.reopen()
    assert pg_rows(contract.db, "SELECT COUNT(*) FROM completions") == before
    # and the gateway serves again once the database is back
    deadline = time.monotonic() + 30
    while contract.call("database_down", "messages", False).status_code != 200:
        assert time.monotonic() < deadline, "no recovery after the database came back"
        time.sleep(0.5)
