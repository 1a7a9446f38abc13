"""A fresh gateway process prepares each active remote run before its first call.

Real gateway app under uvicorn (in a thread), a real stand-in vLLM server process
(`inference.stub_server`), SQLite store. Without the prewarm, a new process loaded a
run's tokenizer and template inside its first call of the run (about two seconds).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from gateway.app import create_app
from inference.stub_server import launch
from rlgate.stack import free_port, stop, wait_healthy
from tests.conftest import ADMIN_KEY, gateway_settings, serving_in_thread

pytestmark = pytest.mark.integration


def _until_loaded(app: FastAPI, run_id: str, timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while run_id not in app.state.pool.loaded() and time.monotonic() < deadline:
        time.sleep(0.05)
    return run_id in app.state.pool.loaded()


def test_a_new_process_loads_active_remote_runs_before_their_first_call(
    tmp_path: Path, model_cache_dir: Path, tiny_model_dir: Path
) -> None:
    port = free_port()
    stub = launch("vllm", port, latency_ms=1, log=tmp_path / "stub.log")
    stub_url = f"http://127.0.0.1:{port}"
    settings = gateway_settings(tmp_path / "data", model_cache_dir)
    try:
        wait_healthy(stub_url, stub, timeout_s=60)
        with serving_in_thread(create_app(settings)) as url:
            admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
            body = {"name": "p", "model": "tiny", "backend": "vllm", "replicas": [stub_url]}
            created = httpx.post(url + "/admin/v1/runs", json=body, headers=admin, timeout=60)
            assert created.status_code == 201, created.text
            run_id = created.json()["run_id"]
            paused = {"name": "q", "model": "tiny", "backend": "vllm", "replicas": [stub_url]}
            other = httpx.post(url + "/admin/v1/runs", json=paused, headers=admin, timeout=60)
            other_id = other.json()["run_id"]
            r = httpx.post(url + f"/admin/v1/runs/{other_id}/pause", headers=admin, timeout=60)
            assert r.status_code == 200, r.text
        requests_before = httpx.get(stub_url + "/stub/state").json()["requests"]
        app = create_app(settings)  # a new process, as after a restart or with --workers N
        with serving_in_thread(app):
            # prepared before the process answered its first request (here: /health)
            assert run_id in app.state.pool.loaded(), "the active run was not prepared"
            assert other_id not in app.state.pool.loaded(), "a paused run waits for its call"
            # a run created through another process (here: another app on the same store)
            # while this one serves is prepared here too, still without a call
            with serving_in_thread(create_app(settings)) as other_url:
                body = {"name": "n", "model": "tiny", "backend": "vllm", "replicas": [stub_url]}
                made = httpx.post(other_url + "/admin/v1/runs", json=body, headers=admin)
                assert made.status_code == 201, made.text
                assert _until_loaded(app, made.json()["run_id"]), "a new run was not prepared"
        # nothing was sampled to get there: no agent call reached the server
        assert httpx.get(stub_url + "/stub/state").json()["requests"] == requests_before
    finally:
        stop(stub)


async def test_prewarm_goes_on_past_a_run_it_cannot_prepare(tmp_path: Path) -> None:
    # A run whose servers are down must not keep the next one from being prepared. The pool
    # is a stand-in that records what it is asked (loading is what the test above checks).
    from sqlalchemy.ext.asyncio import async_sessionmaker

    from core.store.db import make_async_engine
    from core.store.migrate import upgrade
    from core.store.models import Run
    from gateway.agent.completions import ChatService

    url = f"sqlite:///{tmp_path / 'p.db'}"
    await asyncio.to_thread(upgrade, url)
    engine = make_async_engine(url)
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    async with sessions.begin() as s:
        for rid, backend in (("run_a", "vllm"), ("run_b", "sglang"), ("run_c", "local")):
            s.add(Run(id=rid, name=rid, model="tiny", model_path="/x", backend=backend,
                      config={}, counters={}))  # fmt: skip

    class Pool:
        asked: list[str] = []

        def serving_version(self, run_id: str) -> None:
            return None

        async def get(self, run_id: str, *args, **kwargs):
            self.asked.append(run_id)
            if run_id == "run_a":
                raise OSError("servers down")

    pool = Pool()
    try:
        await ChatService(sessions, pool).prewarm()  # type: ignore[arg-type]
    finally:
        await engine.dispose()
    assert sorted(pool.asked) == ["run_a", "run_b"]  # the local run is left to its first call
