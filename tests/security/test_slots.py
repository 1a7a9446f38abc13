"""No slot before a key, bodies with a deadline, caches only admins empty, fair slots per run.

Each test drives a real gateway over HTTP (raw sockets where a well-behaved client
cannot misbehave enough).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from rlgate.stack import stop

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MSGS = [{"role": "user", "content": "hi"}]
TRICKLERS = 2500
# a line of flood calls that first come, first served cannot clear within one deadline
FLOODERS = 256


def _raise_nofile(need: int) -> None:
    """Enough descriptors here and in the gateway started after (it inherits the limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= need, "raise the hard NOFILE limit"


TRICKLER = r"""
import asyncio, json, os, resource, sys, time

host, port, count, seconds, status = sys.argv[1:]
port, count, seconds = int(port), int(count), float(seconds)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
stats = {"opened": 0, "open": 0, "closed_by_server": 0}


async def trickle(stop_at):
    # A keyless sampling call that declares 4 MB and sends a few bytes now and then; once
    # the gateway answers and closes it, the next one opens a second later.
    while time.monotonic() < stop_at:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            await asyncio.sleep(1.0)
            continue
        stats["opened"] += 1
        stats["open"] += 1
        try:
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: 4000000\r\n\r\n{"
            )
            while time.monotonic() < stop_at:
                await asyncio.sleep(1.0)
                if reader.at_eof():
                    stats["closed_by_server"] += 1
                    break
                writer.write(b'"a":1,')
                await writer.drain()
        except OSError:  # answered and closed with the body unread: a reset
            stats["closed_by_server"] += 1
        finally:
            stats["open"] -= 1
            writer.close()
        await asyncio.sleep(1.0)


async def report(stop_at):
    while time.monotonic() < stop_at + 1:
        with open(status + ".tmp", "w") as f:
            json.dump(stats, f)
        os.replace(status + ".tmp", status)
        await asyncio.sleep(0.25)


async def main():
    stop_at = time.monotonic() + seconds
    reporter = asyncio.create_task(report(stop_at))
    tasks = []
    for _ in range(count):
        tasks.append(asyncio.create_task(trickle(stop_at)))
        if len(tasks) % 250 == 0:
            await asyncio.sleep(0.05)
    await asyncio.wait_for(asyncio.gather(*tasks), seconds + 30)
    await reporter


asyncio.run(main())
"""


@contextlib.contextmanager
def _tricklers(url: str, seconds: float, status: Path) -> Iterator[Callable[[], dict]]:
    """TRICKLERS keyless connections kept trickling for `seconds`, from a process of their
    own (2,500 tasks in this one would take the interpreter from the agent's client)."""
    host, port = url.removeprefix("http://").split(":")
    proc = subprocess.Popen(
        [sys.executable, "-c", TRICKLER, host, port, str(TRICKLERS), str(seconds), str(status)]
    )

    def stats() -> dict:
        try:
            return json.loads(status.read_text())
        except (OSError, ValueError):
            return {"opened": 0, "open": 0, "closed_by_server": 0}

    try:
        yield stats
    finally:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def server(gateway_launcher, tmp_path_factory):
    _raise_nofile(3 * TRICKLERS + 1000)
    srv = gateway_launcher(
        tmp_path_factory.mktemp("slots") / "data", body_read_timeout_s=3, auth_cache_ttl_s=120
    )
    yield srv
    stop(srv.proc)


def test_an_agent_is_served_while_keyless_connections_trickle_bodies(server, tmp_path) -> None:
    run = server.create_run(name="trickled")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=run["api_key"], max_retries=0)
    # its model loaded first: the first call of a run in this process loads it
    client.chat.completions.create(model=run["name"], messages=MSGS, max_tokens=2, timeout=120)
    with _tricklers(server.url, 30, tmp_path / "trickle.json") as stats:
        deadline = time.monotonic() + 20
        while stats()["opened"] < TRICKLERS * 0.9 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert stats()["opened"] >= TRICKLERS * 0.9, f"only {stats()} connections opened"
        time.sleep(3)  # the gateway has met them all; they go on trickling, or reconnecting
        before = stats()
        start = time.monotonic()
        answer = client.chat.completions.create(
            model=run["name"], messages=MSGS, max_tokens=2, timeout=5
        )
        took = time.monotonic() - start
        after = stats()
    assert answer.choices and took < 5, (took, before, after)
    print(f"agent answered in {took:.2f} s; tricklers before {before}, after {after}")


def test_a_valid_keys_slow_body_gets_408(server) -> None:
    run = server.create_run(name="slowbody")
    host, port = server.url.removeprefix("http://").split(":")

    async def slow() -> bytes:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Authorization: Bearer " + run["api_key"].encode() + b"\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
        )
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 20)  # read() to EOF: the server closed
        writer.close()
        return answer

    answer = asyncio.run(slow())
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), head
    assert b'"body_read_timeout"' in body


def _revoke_behind_the_gateways_back(server, run: dict) -> None:
    conn = sqlite3.connect(server.db_path, timeout=30)
    with contextlib.closing(conn), conn:
        conn.execute(
            "UPDATE api_keys SET revoked_at = '2020-01-01 00:00:00.000000' WHERE run_id = ?",
            (run["run_id"],),
        )


def test_unauthenticated_admin_posts_do_not_empty_the_key_cache(server) -> None:
    """The key is revoked in the store directly: only a look-up in the store can see it, so
    whether the next call is still served tells whether the cache was emptied."""
    run = server.create_run(name="cached")
    agent = httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {run['api_key']}"}, timeout=60
    )
    assert agent.get("/v1/models").status_code == 200  # cached (ttl 120 s)
    _revoke_behind_the_gateways_back(server, run)
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(f"{server.url}/admin/v1/runs/{run['run_id']}/pause", headers=headers)
        assert r.status_code == 401
    assert agent.get("/v1/models").status_code == 200  # still cached
    # an admin's write does empty it (the contract "revoked at once" for admin writes)
    r = httpx.post(
        f"{server.url}/admin/v1/runs/{run['run_id']}/keys",
        headers=server.admin_headers(),
        timeout=60,
    )
    assert r.status_code == 201
    assert agent.get("/v1/models").status_code == 401


def test_a_flooding_run_leaves_the_other_run_its_share(gateway_launcher, tmp_path) -> None:
    srv = gateway_launcher(
        tmp_path / "data",
        overload_max_inflight=4,
        overload_min_inflight=4,
        overload_queue_timeout_s=8,
    )
    try:
        # Admission unbounded: past a run's admission capacity new conversations are held
        # there (without slots, the test below), which would measure admission, not slots.
        unbounded = {"max_pending_episodes": 10**6}
        flood = srv.create_run(name="flood", config=unbounded)
        quiet = srv.create_run(name="quiet", config=unbounded)
        asyncio.run(_flood_and_probe(srv.url, flood, quiet))
    finally:
        stop(srv.proc)


async def _flood_and_probe(url: str, flood: dict, quiet: dict) -> None:
    stop_at = time.monotonic() + 24
    flood_codes: list[int] = []
    flood_s: list[float] = []

    async def flooder(client: httpx.AsyncClient) -> None:
        body = {"model": flood["name"], "messages": MSGS, "max_tokens": 64, "stream": True}
        while time.monotonic() < stop_at:
            start = time.monotonic()
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                await r.aread()
                flood_codes.append(r.status_code)
            if r.status_code == 200:
                flood_s.append(time.monotonic() - start)

    async with (
        httpx.AsyncClient(
            base_url=url,
            headers={"Authorization": f"Bearer {flood['api_key']}"},
            timeout=60,
            # fresh connections: a pooled one idle past uvicorn's keep-alive may be reset
            limits=httpx.Limits(max_connections=FLOODERS + 10, max_keepalive_connections=0),
        ) as fc,
        httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {quiet['api_key']}"}, timeout=60
        ) as qc,
    ):
        flooders = [asyncio.create_task(flooder(fc)) for _ in range(FLOODERS)]
        await asyncio.sleep(6)  # the flood holds every slot and a long line waits
        quiet_codes = []
        body = {"model": quiet["name"], "messages": MSGS, "max_tokens": 2}
        while time.monotonic() < stop_at - 3:
            r = await qc.post("/v1/chat/completions", json=body)
            quiet_codes.append(r.status_code)
        await asyncio.gather(*flooders)
    waits = f"flood calls took {min(flood_s):.2f}-{max(flood_s):.2f} s"
    assert quiet_codes and set(quiet_codes) == {200}, (quiet_codes, waits)
    # while the flood's own calls waited in line past the deadline: contention was real
    assert flood_codes.count(429) > 0, ("no flood call was turned away", waits)


def test_calls_held_by_a_runs_admission_leave_the_slots_to_other_runs(
    gateway_launcher, tmp_path
) -> None:
    """A run whose trainer is behind (admission full) holds its new conversations for up to
    `admission_wait_s`; they must not sit on the process's slots meanwhile."""
    srv = gateway_launcher(
        tmp_path / "data",
        overload_max_inflight=4,
        overload_min_inflight=4,
        overload_queue_timeout_s=5,
    )
    try:
        stuck = srv.create_run(
            name="stuck", config={"max_pending_episodes": 1, "admission_wait_s": 15}
        )
        quiet = srv.create_run(name="quiet")
        asyncio.run(_held_and_probe(srv.url, stuck, quiet))
    finally:
        stop(srv.proc)


async def _held_and_probe(url: str, stuck: dict, quiet: dict) -> None:
    async def call(client: httpx.AsyncClient, path: str, model: str) -> int:
        body = {"model": model, "messages": MSGS, "max_tokens": 2}
        return (await client.post(path, json=body)).status_code

    async with (
        httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {stuck['api_key']}"}, timeout=60
        ) as sc,
        httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {quiet['api_key']}"}, timeout=60
        ) as qc,
    ):
        assert await call(qc, "/v1/chat/completions", quiet["name"]) == 200  # both warm
        assert await call(sc, "/episodes/first/v1/chat/completions", stuck["name"]) == 200
        held = [  # new conversations past the stuck run's capacity: each is held
            asyncio.create_task(call(sc, f"/episodes/held-{i}/v1/chat/completions", stuck["name"]))
            for i in range(8)
        ]
        await asyncio.sleep(2)
        assert not any(t.done() for t in held), "the stuck run's calls were not held"
        quiet_codes = [await call(qc, "/v1/chat/completions", quiet["name"]) for _ in range(4)]
        held_codes = await asyncio.gather(*held)
    assert quiet_codes == [200] * 4, quiet_codes
    assert set(held_codes) == {429}, held_codes  # held to admission_wait_s, then turned away
