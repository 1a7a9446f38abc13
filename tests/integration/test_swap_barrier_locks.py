"""The swap barrier's locks on a real PostgreSQL, with a stand-in vLLM or SGLang server.

Each `SwapBarrier` below stands for one gateway process (its own lock
connections, its own `ReplicaSet` of clients of the same server). Nothing
here waits on the clock: an ordering is forced by reading `pg_locks` and the
stand-in's counters, and `asyncio.wait_for` only guards against a hang.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from core.store.db import make_sync_engine
from core.store.migrate import upgrade
from core.store.models import Run, RunReplica
from gateway.control.swap_barrier import SWAP_CLASS, SwapBarrier
from inference import registry
from inference.replicas import ReplicaSet
from inference.stub_server import StubConfig, StubState, launch
from inference.types import DRAIN, KEEP, GenerateRequest, GenerateResult, SamplingParams
from rlgate.stack import free_port, stop, wait_healthy

pytestmark = pytest.mark.integration

PG_URL = "postgresql://postgres@127.0.0.1:5432/test"
RUN = "run_swap"
GUARD_S = 60  # a hang guard, not a threshold
TOKENS = 6


@pytest.fixture
def pg_url(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """PG_URL on a fresh schema (the search_path of every libpq connection) with one run."""
    admin = psycopg.connect(PG_URL, autocommit=True, connect_timeout=3)
    schema = "rlgate_swap_" + uuid.uuid4().hex[:10]
    admin.execute(f'CREATE SCHEMA "{schema}"')
    monkeypatch.setenv("PGOPTIONS", f"-c search_path={schema}")
    try:
        yield PG_URL
    finally:
        admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        admin.close()


@pytest.fixture(params=["vllm", "sglang"])
def flavor(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def stub_url(tmp_path: Path, flavor: str) -> Iterator[str]:
    port = free_port()
    extra = ["--token-latency-ms", "150"]  # a request stays in flight for about a second
    proc = launch(flavor, port, output_tokens=TOKENS, extra=extra, log=tmp_path / "stub.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout_s=60)
        yield url
    finally:
        stop(proc)


def _seed(url: str, stub_url: str) -> None:
    upgrade(url)
    with Session(make_sync_engine(url)) as s, s.begin():
        s.add(Run(id=RUN, name="s", model="tiny", model_path="/x", backend="vllm", config={}))
        s.flush()
        s.add(RunReplica(run_id=RUN, url=stub_url, created_at=datetime.now(UTC)))


def _process(url: str, stub_url: str, flavor: str) -> tuple[SwapBarrier, ReplicaSet]:
    """One gateway process's barrier and clients."""
    backend = registry.get(flavor).connect_to(stub_url)
    return SwapBarrier(url), ReplicaSet([(stub_url, backend, stub_url)])


def _stub(stub_url: str) -> dict:
    return httpx.get(stub_url + "/stub/state").json()


async def _until(what: str, predicate) -> None:
    async def poll() -> None:
        while not await asyncio.to_thread(predicate):
            await asyncio.sleep(0.05)

    try:
        await asyncio.wait_for(poll(), GUARD_S)
    except TimeoutError:
        raise AssertionError(f"never: {what}") from None


def _waiting() -> int:
    """Sessions waiting for a swap lock (requests not granted yet)."""
    with psycopg.connect(PG_URL) as conn:
        return conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = %s "
            "AND NOT granted",
            (SWAP_CLASS,),
        ).fetchone()[0]


def _served(url: str) -> int:
    with psycopg.connect(url) as conn:
        return conn.execute(
            "SELECT served_version FROM run_replicas WHERE run_id = %s", (RUN,)
        ).fetchone()[0]


def _sampled_by(prompt: list[int], output: list[int]) -> int | None:
    """The stand-in version whose tokens these are."""
    oracle = StubState(StubConfig(output_tokens=TOKENS))
    for version in range(4):
        oracle.version = version
        if output == [oracle.token(prompt, i)[0] for i in range(len(output))]:
            return version
    return None


async def test_a_drain_swap_waits_for_every_process_to_drain_then_reloads_once(
    pg_url, stub_url, flavor, tiny_model_dir
) -> None:
    _seed(pg_url, stub_url)
    (a, set_a), (b, set_b) = _process(pg_url, stub_url, flavor), _process(pg_url, stub_url, flavor)
    try:
        await a.join(RUN, set_a, None, 0)
        await b.join(RUN, set_b, None, 0)
        prompt = [5, 6, 7]
        request = GenerateRequest(prompt, SamplingParams(max_tokens=TOKENS))
        in_b = asyncio.create_task(set_b.generate(request))
        await _until("B's request running", lambda: _stub(stub_url)["in_flight"] == 1)
        swap_a = asyncio.create_task(a.swap(RUN, set_a, tiny_model_dir, 1, DRAIN))
        await _until("A waiting for the exclusive lock", lambda: _waiting() == 1)
        result = await asyncio.wait_for(in_b, GUARD_S)
        # B holds its shared lock until its own SwapLoop sees the version: nothing reloaded
        assert _stub(stub_url)["reloads"] == 0 and not swap_a.done()
        assert result.policy_version == 0
        assert _sampled_by(prompt, result.output_token_ids) == 0

        await asyncio.wait_for(
            asyncio.gather(swap_a, b.swap(RUN, set_b, tiny_model_dir, 1, DRAIN)), GUARD_S
        )
        assert _stub(stub_url)["reloads"] == 1  # once, by whichever went first
        assert set_a.version == set_b.version == 1 and _served(pg_url) == 1
        after = await set_a.generate(request)
        assert after.policy_version == 1 == _sampled_by(prompt, after.output_token_ids)
    finally:
        for barrier, replicas in ((a, set_a), (b, set_b)):
            await replicas.close()
            await barrier.close()


PAUSE = {  # the stand-in's own pause and resume, freezing requests between two tokens
    "vllm": ("/pause?mode=keep&clear_cache=false", None, "/resume"),
    "sglang": ("/pause_generation", {"mode": "in_place"}, "/continue_generation"),
}


def _freeze(stub_url: str, flavor: str) -> None:
    path, body, _ = PAUSE[flavor]
    httpx.post(stub_url + path, json=body, timeout=10).raise_for_status()


def _thaw(stub_url: str, flavor: str) -> None:
    httpx.post(stub_url + PAUSE[flavor][2], timeout=10).raise_for_status()


def _exact(prompt: list[int], result: GenerateResult) -> bool:
    """Each span's tokens are the stand-in's at the version the span names."""
    ids, spans = result.output_token_ids, result.spans
    ends = [start for start, _ in spans[1:]] + [len(ids)]
    oracle = StubState(StubConfig(output_tokens=TOKENS))
    for (start, version), end in zip(spans, ends, strict=True):
        oracle.version = version
        if ids[start:end] != [oracle.token(prompt, i)[0] for i in range(start, end)]:
            return False
    return True


async def test_a_keep_swap_reloads_once_under_every_process_s_requests_in_flight(
    pg_url, stub_url, flavor, tiny_model_dir
) -> None:
    """Keep: no process drains. B's stream, held on the server between two tokens (as if
    the server were busy), lives through A's reload and goes on with v1, each token
    labelled by the server. A server that labels no tokens (SGLang) is drained instead:
    B's swap waits for its request, which then finishes on v0."""
    _seed(pg_url, stub_url)
    (a, set_a), (b, set_b) = _process(pg_url, stub_url, flavor), _process(pg_url, stub_url, flavor)
    try:
        await a.join(RUN, set_a, None, 0)
        await b.join(RUN, set_b, None, 0)
        prompt = [5, 6, 7]
        stream = set_b.start_stream(GenerateRequest(prompt, SamplingParams(max_tokens=TOKENS)))
        streamed: list[int] = []

        async def consume() -> GenerateResult:
            async for token, _ in stream.tokens():
                streamed.append(token)
            return await stream.result()

        in_b = asyncio.create_task(consume())
        await _until("B's stream under way", lambda: bool(streamed))
        _freeze(stub_url, flavor)
        assert _stub(stub_url)["in_flight"] == 1, "B's request ended before the freeze"
        swap_a = asyncio.create_task(a.swap(RUN, set_a, tiny_model_dir, 1, KEEP))
        await _until("A waiting for the exclusive lock", lambda: _waiting() == 1)
        swap_b = asyncio.create_task(b.swap(RUN, set_b, tiny_model_dir, 1, KEEP))
        if flavor == "sglang":  # drained: B holds its lock while its request is frozen
            assert not swap_a.done() and _stub(stub_url)["reloads"] == 0
            _thaw(stub_url, flavor)
        # vLLM: nothing thaws the request but A's reload, which resumes the server
        await asyncio.wait_for(asyncio.gather(swap_a, swap_b), GUARD_S)
        result = await asyncio.wait_for(in_b, GUARD_S)
        assert streamed == result.output_token_ids
        assert _stub(stub_url)["reloads"] == 1  # once, by whichever went first
        assert set_a.version == set_b.version == 1 and _served(pg_url) == 1
        versions = [v for _, v in result.spans]
        assert versions == ([0, 1] if flavor == "vllm" else [0]), result.spans
        assert len(result.output_token_ids) == TOKENS and _exact(prompt, result)
        after = await set_a.generate(GenerateRequest(prompt, SamplingParams(max_tokens=TOKENS)))
        assert after.spans == ((0, 1),) and _exact(prompt, after)
    finally:
        for barrier, replicas in ((a, set_a), (b, set_b)):
            await replicas.close()
            await barrier.close()


async def _process_joins(barrier: SwapBarrier, replicas: ReplicaSet, ckpt: Path) -> None:
    """What a gateway process does: join at the run's version 1, swap if still behind."""
    await barrier.join(RUN, replicas, ckpt, 1)
    if replicas.version < 1:  # it got in before A's request queued: it swaps like any other
        await barrier.swap(RUN, replicas, ckpt, 1)


async def test_a_process_that_joins_during_a_swap_adopts_its_version(
    pg_url, stub_url, flavor, tiny_model_dir
) -> None:
    _seed(pg_url, stub_url)
    procs = [_process(pg_url, stub_url, flavor) for _ in range(3)]
    (a, set_a), (b, set_b), (c, set_c) = procs
    try:
        await a.join(RUN, set_a, None, 0)
        await b.join(RUN, set_b, None, 0)
        swap_a = asyncio.create_task(a.swap(RUN, set_a, tiny_model_dir, 1))
        await _until("A waiting for the exclusive lock", lambda: _waiting() == 1)
        # C's shared request queues behind A's exclusive one, and B's behind C's: once A has
        # swapped, C holds shared at v1 and never releases it; B must see v1 recorded and
        # adopt it rather than wait for C.
        join_c = asyncio.create_task(_process_joins(c, set_c, tiny_model_dir))
        await _until("C queued", lambda: join_c.done() or _waiting() == 2)
        await asyncio.wait_for(
            asyncio.gather(swap_a, b.swap(RUN, set_b, tiny_model_dir, 1), join_c), GUARD_S
        )
        assert set_a.version == set_b.version == set_c.version == 1
        assert _stub(stub_url)["reloads"] == 1
    finally:
        for barrier, replicas in procs:
            await replicas.close()
            await barrier.close()


async def test_a_dead_process_never_holds_a_swap_and_rejoins_at_the_new_version(
    pg_url, stub_url, flavor, tiny_model_dir
) -> None:
    _seed(pg_url, stub_url)
    (a, set_a), (b, set_b) = _process(pg_url, stub_url, flavor), _process(pg_url, stub_url, flavor)
    try:
        await a.join(RUN, set_a, None, 0)
        await b.join(RUN, set_b, None, 0)
        # B's lock session ends as if its process were SIGKILLed
        pid = await b._locks[RUN].conn.scalar(text("SELECT pg_backend_pid()"))
        with psycopg.connect(PG_URL, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        await asyncio.wait_for(a.swap(RUN, set_a, tiny_model_dir, 1), GUARD_S)
        assert set_a.version == 1 and _stub(stub_url)["reloads"] == 1
        # B's next pass finds its lock gone, takes it again and adopts v1 without a reload
        await asyncio.wait_for(b.check(RUN, set_b), GUARD_S)
        assert set_b.version == 1 and _stub(stub_url)["reloads"] == 1
    finally:
        for barrier, replicas in ((a, set_a), (b, set_b)):
            await replicas.close()
            await barrier.close()
