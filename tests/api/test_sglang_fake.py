"""SGLangBackend against a FAKE SGLang server (`inference.stub_server --flavor sglang`).

The fake is not SGLang (which needs CUDA and cannot run here): it is a
stand-in written from SGLang's documented HTTP API, started as a real
process. These tests check that rlgate speaks that API correctly; they say
nothing about SGLang's own numerics.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from inference.backend import BackendError
from inference.http_common import HttpBackendConfig
from inference.replicas import ReplicaConfig, ReplicaSet
from inference.sglang_http import SGLangBackend
from inference.stub_server import StubConfig, StubState, launch
from inference.types import DRAIN, GenerateRequest, SamplingParams
from rlgate.stack import free_port, stop, wait_healthy

pytestmark = pytest.mark.integration

PROMPT = [5, 6, 7, 8]
LATENCY_MS = 300


def expected(prompt: list[int], n: int, version: int) -> tuple[list[int], list[float]]:
    """What the fake samples, computed by its own deterministic rule (not hard-coded)."""
    state = StubState(StubConfig(flavor="sglang", version=version))
    pairs = [state.token(prompt, i) for i in range(n)]
    return [t for t, _ in pairs], [lp for _, lp in pairs]


@pytest.fixture
def fake_sglang(tmp_path: Path) -> Iterator[str]:
    yield from serve_fake(tmp_path)


@pytest.fixture
def fake_sglang_incremental(tmp_path: Path) -> Iterator[str]:
    yield from serve_fake(tmp_path, "--incremental-streaming-output")


@pytest.fixture
def fake_sglang_slow_tokens(tmp_path: Path) -> Iterator[str]:
    yield from serve_fake(tmp_path, "--token-latency-ms=150")


def serve_fake(tmp_path: Path, *extra: str) -> Iterator[str]:
    port = free_port()
    log = tmp_path / "fake-sglang.log"
    proc = launch("sglang", port, latency_ms=LATENCY_MS, extra=extra, log=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout_s=60)
        yield url
    finally:
        stop(proc)


def backend(url: str, **kw) -> SGLangBackend:
    return SGLangBackend(HttpBackendConfig(base_url=url, **kw))


def req(n: int = 4, **params) -> GenerateRequest:
    return GenerateRequest(PROMPT, SamplingParams(max_tokens=n, **params))


async def test_generate_returns_ids_logprobs_and_finish(fake_sglang: str) -> None:
    be = backend(fake_sglang)
    result = await be.generate(req(5))
    ids, lps = expected(PROMPT, 5, 0)
    assert result.output_token_ids == ids
    assert result.output_logprobs == pytest.approx(lps)
    assert result.finish_reason == "length" and result.policy_version == 0
    # a stop token ends generation with "stop", and is kept in the output ids
    stopped = await be.generate(req(5, stop_token_ids=(ids[2],)))
    assert stopped.output_token_ids == ids[:3] and stopped.finish_reason == "stop"
    assert await be.health()
    await be.close()


async def test_stream_yields_the_same_tokens_as_generate(fake_sglang: str) -> None:
    be = backend(fake_sglang)
    stream = be.start_stream(req(6))
    got = [pair async for pair in stream.tokens()]
    ids, lps = expected(PROMPT, 6, 0)
    assert [t for t, _ in got] == ids
    assert [lp for _, lp in got] == pytest.approx(lps)
    result = await stream.result()
    assert result.output_token_ids == ids and result.finish_reason == "length"
    await be.close()


async def test_stream_reads_incremental_streaming_output(fake_sglang_incremental: str) -> None:
    be = backend(fake_sglang_incremental)
    got = [t async for t, _ in be.start_stream(req(6)).tokens()]
    assert got == expected(PROMPT, 6, 0)[0]
    await be.close()


async def test_stream_cancel_keeps_the_partial_result(fake_sglang: str) -> None:
    be = backend(fake_sglang)
    stream = be.start_stream(req(6))
    stream.cancel()  # before the first token (the fake waits LATENCY_MS)
    result = await stream.result()
    assert result.finish_reason == "cancelled" and result.output_token_ids == []
    await be.close()


async def test_drain_swap_drains_then_serves_the_new_version(
    fake_sglang: str, tmp_path: Path
) -> None:
    be = backend(fake_sglang)
    in_flight = asyncio.create_task(be.generate(req(3)))
    await asyncio.sleep(0.05)
    await be.load_weights(tmp_path / "v1", 1, DRAIN)
    old = await in_flight
    assert old.policy_version == 0, "a request running at swap time finishes on its version"
    assert old.output_token_ids == expected(PROMPT, 3, 0)[0]
    new = await be.generate(req(3))
    assert new.policy_version == 1 and be.version == 1
    assert new.output_token_ids == expected(PROMPT, 3, 1)[0], "the fake now serves new weights"
    state = httpx.get(fake_sglang + "/stub/state").json()
    assert state["weights_path"] == str(tmp_path / "v1")
    assert state["weight_version"] == "1" and state["paused"] is False
    assert state["pause"] is None and state["tokens_while_paused"] == 0
    await be.close()


async def test_dead_server_is_a_backend_error(tmp_path: Path) -> None:
    be = backend(f"http://127.0.0.1:{free_port()}", connect_timeout_s=1)
    assert not await be.health()
    with pytest.raises(BackendError):
        await be.generate(req())
    with pytest.raises(BackendError):
        await be.start_stream(req()).result()
    await be.close()


async def test_replica_set_fails_over_when_a_fake_is_killed(tmp_path: Path) -> None:
    ports = [free_port(), free_port()]
    procs = [launch("sglang", p, latency_ms=LATENCY_MS, log=tmp_path / f"r{p}.log") for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for url, proc in zip(urls, procs, strict=True):
            wait_healthy(url, proc, timeout_s=60)
        rs = ReplicaSet(
            [(f"r{i}", backend(u, connect_timeout_s=1), u) for i, u in enumerate(urls)],
            ReplicaConfig(health_interval_s=0.2),
        )
        first = await asyncio.gather(*(rs.generate(req(2)) for _ in range(4)))
        assert len(first) == 4
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].wait()
        results = await asyncio.gather(*(rs.generate(req(2)) for _ in range(6)))
        assert all(r.output_token_ids == expected(PROMPT, 2, 0)[0] for r in results)
        status = {s["name"]: s for s in rs.replica_status()}
        assert status["r0"]["healthy"] is False and status["r1"]["healthy"] is True
        await rs.load_weights(tmp_path / "v1", 1)  # rolls over the live replica only
        assert (await rs.generate(req(2))).policy_version == 1
        await rs.close()
    finally:
        for proc in procs:
            stop(proc)


async def test_swap_aborts_stragglers_after_the_drain_timeout(
    fake_sglang_slow_tokens: str, tmp_path: Path
) -> None:
    """The drain-timeout policy of every HTTP backend (`inference.http_backend`): requests
    still running when the drain times out fail with BackendError, then the swap goes on.
    What a straggler streamed before that came from the old weights only."""
    be = backend(fake_sglang_slow_tokens, drain_timeout_s=0.2)
    stuck = asyncio.create_task(be.generate(req(8)))
    stream = be.start_stream(req(8))
    got: list[int] = []
    swap = None
    with pytest.raises(BackendError, match="drain timeout"):
        async for token, _ in stream.tokens():
            got.append(token)
            if swap is None:  # mid-stream: swap now
                swap = asyncio.create_task(be.load_weights(tmp_path / "v1", 1, DRAIN))
    assert swap is not None
    await swap
    with pytest.raises(BackendError, match="drain timeout"):
        await stuck
    assert 1 <= len(got) < 8 and got == expected(PROMPT, 8, 0)[0][: len(got)]
    assert be.version == 1 and (await be.generate(req(2))).policy_version == 1
    await be.close()
