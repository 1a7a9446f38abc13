"""A keep-mode rolling swap of a `ReplicaSet` over two real stand-in servers, under load.

The servers are `inference.stub_server` processes (vLLM and SGLang flavors) on
loopback, reached through the real HTTP backends. The stand-in's token i is a
known function of the prompt, i and the weights version that sampled it, so a
result's `version_starts` can be checked token by token against it.

The orderings asserted are structural: long generations that started before
the roll are still running when it ends and finish after every call made
during it; `asyncio.wait_for` only guards against a hang.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from inference import registry
from inference.replicas import ReplicaConfig, ReplicaSet
from inference.stub_server import StubConfig, StubState, launch
from inference.swap import ServerClient, WeightsSource
from inference.types import DRAIN, GenerateRequest, GenerateResult, SamplingParams, SwapPolicy
from rlgate.stack import free_port, stop, wait_healthy

pytestmark = pytest.mark.integration

MAX_TOKENS = 1000  # the stand-ins' cap on an answer
TOKEN_MS = 10  # between two tokens: a long call (LONG tokens) runs for seconds
LONG = 600
SHORT = 3
GUARD_S = 120  # a hang guard, not a threshold


@pytest.fixture(params=["vllm", "sglang"])
def flavor(request: pytest.FixtureRequest) -> str:
    return request.param


@dataclass
class Server:
    url: str
    proc: subprocess.Popen


@pytest.fixture
def stubs(tmp_path: Path, flavor: str) -> Iterator[list[Server]]:
    started: list[Server] = []
    try:
        for i in range(2):
            port = free_port()
            extra = [f"--token-latency-ms={TOKEN_MS}"]
            log = tmp_path / f"stub{i}.log"
            proc = launch(flavor, port, output_tokens=MAX_TOKENS, extra=extra, log=log)
            started.append(Server(f"http://127.0.0.1:{port}", proc))
        for server in started:
            wait_healthy(server.url, server.proc, timeout_s=60)
        yield started
    finally:
        for server in started:
            stop(server.proc)


@pytest.fixture
def servers(stubs: list[Server]) -> list[str]:
    return [server.url for server in stubs]


def _set(urls: list[str], flavor: str) -> tuple[ReplicaSet[ServerClient], list[ServerClient]]:
    """A replica set over `urls` and its clients, in the same order."""
    kind = registry.get(flavor)
    clients = [kind.connect_to(url) for url in urls]
    members = [(url, client, url) for url, client in zip(urls, clients, strict=True)]
    return ReplicaSet(members, ReplicaConfig(health_interval_s=0.5)), clients


def _state(url: str) -> dict:
    return httpx.get(url + "/stub/state", timeout=10).json()


def _request(prompt: list[int], n: int) -> GenerateRequest:
    return GenerateRequest(prompt, SamplingParams(max_tokens=n))


def exact(prompt: list[int], result: GenerateResult) -> bool:
    """Every token is the stand-in's token for the version its span names."""
    oracle = StubState(StubConfig(output_tokens=MAX_TOKENS))
    ids = result.output_token_ids
    spans = result.spans
    ends = [start for start, _ in spans[1:]] + [len(ids)]
    for (start, version), end in zip(spans, ends, strict=True):
        oracle.version = version
        if ids[start:end] != [oracle.token(prompt, i)[0] for i in range(start, end)]:
            return False
    return True


async def _until(what: str, predicate) -> None:
    async def poll() -> None:
        while not await asyncio.to_thread(predicate):
            await asyncio.sleep(0.02)

    try:
        await asyncio.wait_for(poll(), GUARD_S)
    except TimeoutError:
        raise AssertionError(f"never: {what}") from None


async def test_a_keep_roll_pauses_no_call_for_another_and_labels_every_token(
    servers: list[str], flavor: str, tiny_model_dir: Path
) -> None:
    rs, clients = _set(servers, flavor)
    finished: list[str] = []  # call names, in the order they finished
    try:
        # Two long calls, one streamed and one not: by least outstanding, one per server.
        long_prompt_s, long_prompt_g = [11, 12, 13], [21, 22, 23]
        stream = rs.start_stream(_request(long_prompt_s, LONG))
        streamed: list[int] = []

        async def consume() -> GenerateResult:
            async for token, _ in stream.tokens():
                streamed.append(token)
            finished.append("long-stream")
            return await stream.result()

        async def long_call() -> GenerateResult:
            result = await rs.generate(_request(long_prompt_g, LONG))
            finished.append("long-call")
            return result

        long_s = asyncio.create_task(consume())
        long_g = asyncio.create_task(long_call())
        await _until(
            "a long call on each server", lambda: all(_state(u)["in_flight"] == 1 for u in servers)
        )
        await _until("the long stream under way", lambda: len(streamed) >= 2)

        # New calls keep arriving, streamed and not, while the version rolls over.
        shorts: list[tuple[list[int], GenerateResult]] = []
        rolled = asyncio.Event()

        async def caller(n: int) -> None:
            i = 0
            while not rolled.is_set():
                i += 1
                prompt = [n, i, 7]
                if i % 2:
                    result = await rs.generate(_request(prompt, SHORT))
                else:
                    s = rs.start_stream(_request(prompt, SHORT))
                    async for _ in s.tokens():
                        pass
                    result = await s.result()
                shorts.append((prompt, result))
                finished.append("short")

        # While each server reloads, one more call starts: it must go to the other one.
        routed: list[tuple[str, str | None]] = []  # (the server reloading, the call's server)

        def _probed(name: str, backend: ServerClient) -> Callable[..., Awaitable[None]]:
            real = backend.load_weights

            async def load_weights(source: WeightsSource, version: int, policy: SwapPolicy) -> None:
                reload = asyncio.create_task(real(source, version, policy))
                prompt = [len(routed) + 50, 8]
                during = rs.start_stream(_request(prompt, SHORT))
                routed.append((name, during.replica))
                async for _ in during.tokens():
                    pass
                shorts.append((prompt, await during.result()))
                finished.append("short")
                await reload

            return load_weights

        for url, client in zip(servers, clients, strict=True):
            client.load_weights = _probed(url, client)  # type: ignore[method-assign]

        callers = [asyncio.create_task(caller(n)) for n in range(1, 5)]
        await asyncio.wait_for(rs.load_weights(tiny_model_dir, 1), GUARD_S)  # keep: default
        assert not long_s.done() and not long_g.done(), "the long calls outlive the roll"
        rolled.set()
        await asyncio.wait_for(asyncio.gather(*callers), GUARD_S)
        results = await asyncio.wait_for(asyncio.gather(long_s, long_g), GUARD_S)

        # No call failed, and none waited for another's generation: every short call,
        # including those made while a server reloaded, finished before the long ones.
        assert set(finished[-2:]) == {"long-stream", "long-call"}
        assert finished.count("short") == len(shorts)
        assert routed == [(servers[0], servers[1]), (servers[1], servers[0])]
        assert any(r.policy_version == 1 for _, r in shorts)
        # The long calls lived through their server's reload: each token labelled exactly.
        for prompt, result in zip((long_prompt_s, long_prompt_g), results, strict=True):
            assert [v for _, v in result.spans] == [0, 1], result.spans
            assert len(result.output_token_ids) == LONG and exact(prompt, result)
        assert streamed == results[0].output_token_ids
        assert all(exact(p, r) for p, r in shorts), "a short call's tokens mislabelled"
        assert rs.version == 1 and [s["version"] for s in rs.replica_status()] == [1, 1]
        for url in servers:
            state = _state(url)
            assert state["reloads"] == 1 and state["tokens_while_paused"] == 0, state
    finally:
        await rs.close()


async def test_drain_still_finishes_calls_on_the_old_weights(
    servers: list[str], flavor: str, tiny_model_dir: Path
) -> None:
    rs, _ = _set(servers, flavor)
    try:
        prompt = [31, 32, 33]
        call = asyncio.create_task(rs.generate(_request(prompt, 200)))
        await _until("the call under way", lambda: any(_state(u)["in_flight"] for u in servers))
        await asyncio.wait_for(rs.load_weights(tiny_model_dir, 1, DRAIN), GUARD_S)
        assert call.done(), "drain reloads a server only once its calls have finished"
        result = call.result()
        assert result.spans == ((0, 0),) and exact(prompt, result)
        after = await rs.generate(_request(prompt, SHORT))
        assert after.spans == ((0, 1),) and exact(prompt, after)
    finally:
        await rs.close()


async def test_a_call_that_lived_through_a_reload_and_lost_its_server_moves_whole(
    stubs: list[Server], servers: list[str], flavor: str, tiny_model_dir: Path
) -> None:
    """A non-streaming call whose server dies after a keep-mode reload is answered, whole,
    by the other replica: nothing of the failed attempt reaches the result."""
    rs, _ = _set(servers, flavor)
    try:
        prompt = [41, 42, 43]
        call = asyncio.create_task(rs.generate(_request(prompt, LONG)))
        await _until("the call on the first server", lambda: _state(servers[0])["in_flight"])
        roll = asyncio.create_task(rs.load_weights(tiny_model_dir, 1))

        async def first_reloaded() -> None:
            while (s := rs.replica_status()[0])["version"] < 1 or s["loading"]:
                await asyncio.sleep(0.02)

        await asyncio.wait_for(first_reloaded(), GUARD_S)
        assert not call.done(), "the call lived through its server's reload"
        stubs[0].proc.send_signal(signal.SIGKILL)
        stubs[0].proc.wait()
        # the second server may be paused for its own reload: the call then waits for it
        result = await asyncio.wait_for(call, GUARD_S)
        await asyncio.wait_for(roll, GUARD_S)
        assert len(result.output_token_ids) == LONG and exact(prompt, result)
        assert result.spans[-1][1] == 1 and _state(servers[1])["reloads"] == 1
        assert [s["healthy"] for s in rs.replica_status()] == [False, True]
    finally:
        await rs.close()
