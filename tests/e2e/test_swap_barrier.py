"""Two gateway processes under load while versions commit: one reload per version, true labels.

`rlgate up --workers 2` over PostgreSQL, one stand-in vLLM server
(`inference.stub_server`), agents calling through both processes while the
test commits versions 1 and 2, with the run's `swap_mode` keep (requests in
flight go on through the reload) or drain. The stand-in's tokens are a
function of the prompt and of the weights that sampled each one, so every
stored completion says which weights sampled it: its `policy_version`, and
with keep its `version_starts` where a swap happened mid-answer, must name
them token by token. Without the swap barrier (gateway/control/swap_barrier.py)
each process reloads the server itself: it is reloaded twice per version,
and a process that has not swapped yet labels the new weights' tokens with
the old version.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import httpx
import psycopg
import pytest

from core.store.types import IntArray
from inference.stub_server import StubConfig, StubState
from rlgate.stack import free_port, stop, wait_healthy
from tests.e2e.test_up_workers import (  # noqa: F401  (fixtures)
    ADMIN,
    _commit_step,
    _gateways,
    _scrape,
    _up,
    _wait,
    pg_url,
    queue,
)
from tests.faults.load_agents import start_stub

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKENS = 4
TOKEN_MS = 25  # between two tokens: some answers are under way when a swap comes


def _load(base_url: str, key: str, stop_at: threading.Event, errors: list[str]) -> None:
    """One agent: calls on fresh connections (so both processes get them) until told to stop."""
    i = 0
    while not stop_at.is_set():
        i += 1
        body = {"model": "w", "messages": [{"role": "user", "content": f"q{i}"}]}
        try:
            resp = httpx.post(
                base_url + "/chat/completions",
                json=body | {"max_tokens": TOKENS},
                headers={"Authorization": f"Bearer {key}"},
                timeout=60,
            )
        except httpx.HTTPError as exc:
            errors.append(repr(exc))
            continue
        if resp.status_code != 200:
            errors.append(f"{resp.status_code} {resp.text[:200]}")


def _served(url: str, run_id: str, gateways: list[int], version: int) -> bool:
    seen: dict[int, float] = {}
    for _ in range(12):  # fresh connections land on either process
        pid, _, served = _scrape(url)
        seen[pid] = served.get(run_id, -1)
    return all(seen.get(p) == version for p in gateways)


@pytest.mark.parametrize("swap_mode", ["keep", "drain"])
def test_two_processes_reload_the_server_once_per_version_and_label_it_truly(
    tmp_path,
    model_cache_dir,
    tiny_model_dir,
    pg_url,  # noqa: F811
    queue,  # noqa: F811
    swap_mode: str,
) -> None:
    stub_port, port = free_port(), free_port()
    stub = start_stub(stub_port, latency_ms=30, tokens=TOKENS, token_latency_ms=TOKEN_MS)
    up, log = _up(tmp_path, model_cache_dir, pg_url, queue, port)
    url = f"http://127.0.0.1:{port}"
    stop_at, errors, agents = threading.Event(), [], []
    try:
        wait_healthy(url, up, timeout_s=180)
        gateways = _wait("two gateway processes", lambda: len(g := _gateways(up)) == 2 and g)
        run = httpx.post(
            url + "/admin/v1/runs",
            json={
                "name": "w",
                "model": "tiny",
                "backend": "vllm",
                "replicas": [f"http://127.0.0.1:{stub_port}"],
                "config": {"max_pending_episodes": 10**6, "swap_mode": swap_mode},
            },
            headers={"Authorization": f"Bearer {ADMIN}"},
            timeout=120,
        )
        assert run.status_code == 201, run.text
        run = run.json()
        run_id = run["run_id"]
        for _ in range(6):
            agent = threading.Thread(
                target=_load, args=(run["base_url"], run["api_key"], stop_at, errors)
            )
            agent.start()
            agents.append(agent)
        _wait("both processes serve v0", lambda: _served(url, run_id, gateways, 0), 120)
        for version in (1, 2):
            ckpt = tmp_path / f"ckpt-v{version}"
            shutil.copytree(tiny_model_dir, ckpt)
            _commit_step(pg_url, run_id, version - 1, ckpt)
            _wait(
                f"both serve v{version}", lambda v=version: _served(url, run_id, gateways, v), 120
            )
            # calls keep landing on the new weights in both processes before the next commit
            before = _stub(stub_port)["requests"]
            _wait("more calls", lambda n=before: _stub(stub_port)["requests"] > n + 20)
        stop_at.set()
        for agent in agents:
            agent.join(90)
        _wait("the calls stored", lambda: _stored(pg_url, run_id) and True)
        rows = _stored(pg_url, run_id)
        oracle = StubState(StubConfig(output_tokens=TOKENS))
        wrong, per_version, spanning = [], {0: 0, 1: 0, 2: 0}, 0
        for cid, prompt, output, starts in rows:
            ends = [i for i, _ in starts[1:]] + [len(output)]
            expected = []
            for (start, version), end in zip(starts, ends, strict=True):
                oracle.version = version
                expected += [oracle.token(prompt, i)[0] for i in range(start, end)]
            if output != expected:
                wrong.append((cid, starts))
            per_version[starts[0][1]] += 1
            spanning += len(starts) > 1
        assert not wrong, f"{len(wrong)} of {len(rows)} completions mislabelled: {wrong[:5]}"
        if swap_mode == "drain":
            assert spanning == 0, "a drained swap leaves every completion on one version"
        state = _stub(stub_port)
        assert state["reloads"] == 2, state  # once per version, not once per process
        assert state["tokens_while_paused"] == 0, state
        assert all(per_version.values()), per_version  # each version sampled some
        assert not errors, errors[:5]
    finally:
        stop_at.set()
        for agent in agents:
            agent.join(30)
        stop(up)
        stop(stub)
    assert "unhandled error" not in log.read_text()
    assert Path(log).read_text().count(f"run {run_id}: v2 adopted") == 1  # the other reloaded


def _stub(port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/stub/state").json()


def _stored(db: str, run_id: str) -> list[tuple[str, list[int], list[int], list[list[int]]]]:
    """(id, prompt, output, where each version began) of every stored completion."""
    with psycopg.connect(db) as conn:
        rows = conn.execute(
            "SELECT id, prompt_token_ids, output_token_ids, policy_version, version_starts "
            "FROM completions WHERE run_id = %s",
            (run_id,),
        ).fetchall()
    return [(cid, _ints(p), _ints(o), starts or [[0, v]]) for cid, p, o, v, starts in rows]


def _ints(packed: bytes) -> list[int]:
    return IntArray().process_result_value(packed, None)
