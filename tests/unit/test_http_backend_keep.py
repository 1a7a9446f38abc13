"""Keep-mode hot swaps in the shared HTTP backend (`inference.http_backend`), over real HTTP.

Each test starts the stand-in server (`inference.stub_server`) on loopback.
Its tokens are a function of the weights version that sampled them, so a
result shows exactly which version sampled each token: every in-flight
call's `version_starts` must change once, at the index where the pause
took effect, and the tokens on either side must be the old and the new
weights'. Two backends: `SGLangBackend` (no per-token labels: the backend
marks streams itself, and sends non-streaming calls as streams) against
the SGLang flavor, which is a stand-in, not SGLang (no CPU build exists);
and `Labelled`, a minimal backend of vLLM 0.32's `/inference/v1/generate`,
whose `weight_versions` labels win over the marks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from inference.backend import BackendError, VersionMoved
from inference.http_backend import Completion, HttpBackend, HttpStream, StreamEvent, Tokens
from inference.http_common import HttpBackendConfig, version_starts_of
from inference.sglang_http import SGLangBackend
from inference.stub_server import StubConfig, StubState, adapter_salt
from inference.types import (
    DRAIN,
    KEEP,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    SwapPolicy,
)
from tests.unit.test_stub_keep import serve as stub_server

PROMPT = [9, 8, 7, 6]
N = 50  # tokens per in-flight call: they outlast the swap by far
KEEP_KV = SwapPolicy(mode="keep", clear_kv=False)


def tokens_of(version: int, n: int, salt: int = 0) -> list[int]:
    """The stand-in's tokens 0..n-1 for PROMPT at weights `version` (its own rule)."""
    state = StubState(StubConfig(version=version))
    return [state.token(PROMPT, i, salt)[0] for i in range(n)]


def req(n: int = N, adapter: str | None = None) -> GenerateRequest:
    return GenerateRequest(PROMPT, SamplingParams(max_tokens=n), adapter=adapter)


def serve(tmp_path: Path, flavor: str) -> Iterator[str]:
    return stub_server(tmp_path, flavor, "--token-latency-ms=40", output_tokens=N)


@pytest.fixture
def sglang_stub(tmp_path: Path) -> Iterator[str]:
    yield from serve(tmp_path, "sglang")


@pytest.fixture
def vllm_stub(tmp_path: Path) -> Iterator[str]:
    yield from serve(tmp_path, "vllm")


def stub_state(url: str) -> dict[str, Any]:
    return httpx.get(url + "/stub/state").json()


class Labelled(HttpBackend):
    """vLLM 0.32's token-in/token-out API, as small as a backend gets: `/inference/v1/generate`
    with `weight_versions`, `/pause?mode=keep|wait`, `reload_weights`, a label per version."""

    name = "labelled"
    labels_tokens = True
    fail_reload = False

    @staticmethod
    def _body(request: GenerateRequest, stream: bool) -> dict[str, Any]:
        params = {"max_tokens": request.params.max_tokens, "logprobs": 0}
        return {"token_ids": request.prompt_token_ids, "sampling_params": params, "stream": stream}

    @staticmethod
    def _pairs(choice: dict[str, Any]) -> Tokens:
        return [(c["token_id"], c["logprob"]) for c in choice["logprobs"]["content"]]

    async def _complete(self, request: GenerateRequest) -> Completion:
        answer = await self._post("/inference/v1/generate", self._body(request, False))
        choice = answer["choices"][0]
        pairs = self._pairs(choice)
        starts = version_starts_of(choice.get("weight_versions"), len(pairs))
        return Completion(pairs, choice["finish_reason"], starts)

    async def _stream_tokens(self, request: GenerateRequest) -> AsyncIterator[StreamEvent]:
        n = 0
        async for event in self._events("/inference/v1/generate", self._body(request, True)):
            choice = event["choices"][0]
            pairs = self._pairs(choice)
            n += len(pairs)
            starts = version_starts_of(choice.get("weight_versions"), n)
            yield StreamEvent(pairs, choice["finish_reason"], starts)

    async def _pause(self, policy: SwapPolicy) -> None:
        mode = "keep" if policy.mode == "keep" else "wait"
        clear = "true" if policy.clear_kv else "false"
        await self._control("/pause", params={"mode": mode, "clear_cache": clear})

    async def _reload(self, checkpoint_dir: Path, version: int) -> None:
        if self.fail_reload:
            raise BackendError("the server refused the weights")
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(checkpoint_dir)}}
        await self._control("/collective_rpc", json=rpc)
        await self._control("/update_weight_version", json={"new_version": str(version)})

    async def _resume(self) -> None:
        await self._control("/resume")


async def started(url: str, streams: list[HttpStream], calls: int) -> list[asyncio.Task]:
    """Tasks reading `streams` to their results, once each has received two tokens and the
    server has every call (`calls` in all) in flight."""
    seen = [asyncio.Event() for _ in streams]

    async def read(stream: HttpStream, two: asyncio.Event) -> GenerateResult:
        n = 0
        async for _ in stream.tokens():
            n += 1
            if n >= 2:
                two.set()
        return await stream.result()

    tasks = [asyncio.create_task(read(s, e)) for s, e in zip(streams, seen, strict=True)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in seen)), 60)
    while stub_state(url)["in_flight"] < calls:
        await asyncio.sleep(0.02)
    return tasks


def assert_switched_once(result: GenerateResult, old: list[int], new: list[int]) -> int:
    """The result changed version exactly once, where its tokens stop being the old weights'."""
    (_, v0), (k, v1) = result.version_starts
    assert (v0, v1) == (0, 1) and result.policy_version == 0 and 0 < k < N
    assert result.output_token_ids == old[:k] + new[k:]
    return k


async def swap_under_load(
    backend: HttpBackend, url: str, tmp_path: Path, policy: SwapPolicy
) -> None:
    """Two streams and two non-streaming calls in flight through a keep-mode swap."""
    streams = [backend.start_stream(req()) for _ in range(2)]
    calls = [asyncio.create_task(backend.generate(req())) for _ in range(2)]
    readers = await started(url, streams, 4)
    await backend.load_weights(tmp_path / "v1", 1, policy)
    inflight = [*readers, *calls]
    assert not any(t.done() for t in inflight), "the swap did not wait for calls in flight"
    fresh = await backend.generate(req(2))
    assert not any(t.done() for t in inflight), "a new call did not wait for them either"
    assert fresh.policy_version == 1 and fresh.version_starts == ()
    assert fresh.output_token_ids == tokens_of(1, 2)
    for result in await asyncio.gather(*inflight):
        assert_switched_once(result, tokens_of(0, N), tokens_of(1, N))
    state = stub_state(url)
    assert state["tokens_while_paused"] == 0 and state["pause"] is None
    assert backend.version == 1


@pytest.mark.parametrize("policy", [KEEP, KEEP_KV], ids=["retract", "in_place"])
async def test_sglang_keep_swap_marks_every_call_where_the_new_version_began(
    sglang_stub: str, tmp_path: Path, policy: SwapPolicy
) -> None:
    backend = SGLangBackend(HttpBackendConfig(base_url=sglang_stub))
    try:
        await swap_under_load(backend, sglang_stub, tmp_path, policy)
    finally:
        await backend.close()
    mode = "retract" if policy.clear_kv else "in_place"  # in_place: reload sent flush_cache false
    assert stub_state(sglang_stub)["last_pause"] == {"mode": mode}


async def test_server_labels_give_each_call_its_versions(vllm_stub: str, tmp_path: Path) -> None:
    """The non-streaming calls go out as one JSON call each, which the backend cannot mark:
    only the server's `weight_versions` can tell where their versions changed. Before the
    swap the server's label is its own first one, no version number: those tokens get the
    version the call was admitted on."""
    backend = Labelled(HttpBackendConfig(base_url=vllm_stub))
    try:  # the tokens before the swap carry the server's first label, "default"
        await swap_under_load(backend, vllm_stub, tmp_path, KEEP)
    finally:
        await backend.close()
    state = stub_state(vllm_stub)
    assert state["last_pause"] == {"mode": "keep", "clear_cache": True}
    assert state["weight_version"] == "1"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_a_request_that_must_start_on_a_swapped_out_version_is_refused(
    vllm_stub: str, tmp_path: Path, stream: bool
) -> None:
    """`GenerateRequest.version` is checked where the backend admits the call, the moment it
    takes the version it reports: after a swap a call bound to the old one reaches no server."""
    backend = Labelled(HttpBackendConfig(base_url=vllm_stub))
    pinned = GenerateRequest(PROMPT, SamplingParams(max_tokens=4), version=0)

    async def call(request: GenerateRequest) -> GenerateResult:
        if not stream:
            return await backend.generate(request)
        return await backend.start_stream(request).result()

    try:
        assert (await call(pinned)).policy_version == 0
        await backend.load_weights(tmp_path, 1)
        served = stub_state(vllm_stub)["requests"]
        with pytest.raises(VersionMoved, match="serves v1, not v0"):
            await call(pinned)
        assert stub_state(vllm_stub)["requests"] == served
        assert (
            await call(GenerateRequest(PROMPT, SamplingParams(max_tokens=4), version=1))
        ).policy_version == 1
    finally:
        await backend.close()


async def test_a_failed_keep_load_marks_nothing_and_resumes(vllm_stub: str, tmp_path: Path) -> None:
    backend = Labelled(HttpBackendConfig(base_url=vllm_stub))
    backend.fail_reload = True
    try:
        stream = backend.start_stream(req())
        (reader,) = await started(vllm_stub, [stream], 1)
        with pytest.raises(BackendError, match="refused the weights"):
            await backend.load_weights(tmp_path / "v1", 1)
        result = await reader
    finally:
        await backend.close()
    assert backend.version == 0 and result.version_starts == () and result.policy_version == 0
    assert result.output_token_ids == tokens_of(0, N)
    assert stub_state(vllm_stub)["pause"] is None


async def test_drain_swap_waits_for_calls_in_flight(sglang_stub: str, tmp_path: Path) -> None:
    backend = SGLangBackend(HttpBackendConfig(base_url=sglang_stub))
    try:
        stream = backend.start_stream(req(8))
        call = asyncio.create_task(backend.generate(req(8)))
        (reader,) = await started(sglang_stub, [stream], 2)
        await backend.load_weights(tmp_path / "v1", 1, DRAIN)
        assert reader.done() and call.done(), "drain: the swap waits for them"
        for result in (await reader, await call):
            assert result.version_starts == () and result.policy_version == 0
            assert result.output_token_ids == tokens_of(0, 8)
        assert (await backend.generate(req(2))).output_token_ids == tokens_of(1, 2)
    finally:
        await backend.close()
    assert stub_state(sglang_stub)["last_pause"] == {"mode": "wait"}  # the empty body


def test_server_labels_become_version_starts() -> None:
    def span(label: str, start: int, end: int) -> dict[str, Any]:
        return {"version": label, "start": start, "end": end}

    labels = [span("4", 5, 9), span("3", 0, 5)]  # any order; contiguous
    assert version_starts_of(labels, 9) == ((0, 3), (5, 4))
    assert version_starts_of([span("3", 0, 2), span("3", 2, 4)], 4) == ((0, 3),)
    assert version_starts_of([span("2", 0, 0), span("3", 0, 4)], 4) == ((0, 3),)  # empty span
    assert version_starts_of([span("default", 0, 4)], 4) is None  # not a version number
    assert version_starts_of([span("4", 0, 2), span("3", 2, 4)], 4) is None  # going back
    # vLLM's first label: the tokens before rlgate's first label are left to the caller
    assert version_starts_of([span("default", 0, 2), span("3", 2, 4)], 4) == ((2, 3),)
    assert version_starts_of([span("3", 0, 2), span("default", 2, 4)], 4) is None
    assert version_starts_of(None, 4) is None and version_starts_of([], 0) is None


def adapter_dir(root: Path, name: str) -> Path:
    path = (root / name).resolve()
    path.mkdir()
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        (path / file).write_text("{}")
    return path


async def test_keep_adapter_swap_marks_only_the_adapters_calls(
    sglang_stub: str, tmp_path: Path
) -> None:
    """The whole server pauses for the adapter's load; a base-model stream in flight is
    frozen for that long but sampled by the same weights throughout."""
    first, second = adapter_dir(tmp_path, "a1"), adapter_dir(tmp_path, "a2")
    backend = SGLangBackend(HttpBackendConfig(base_url=sglang_stub))
    try:
        await backend.load_adapter("a", first, 1)
        streams = [backend.start_stream(req(adapter="a")), backend.start_stream(req())]
        call = asyncio.create_task(backend.generate(req(adapter="a")))
        adapter_reader, base_reader = await started(sglang_stub, streams, 3)
        await backend.load_adapter("a", second, 2)
        assert backend.adapter_version("a") == 2 and backend.version == 0
        old = tokens_of(0, N, adapter_salt("a", str(first)))
        new = tokens_of(0, N, adapter_salt("a", str(second)))
        for result in (await adapter_reader, await call):
            (_, v1), (k, v2) = result.version_starts
            assert (v1, v2) == (1, 2) and 0 < k < N
            assert result.output_token_ids == old[:k] + new[k:]
        base = await base_reader
        assert base.version_starts == () and base.output_token_ids == tokens_of(0, N)
    finally:
        await backend.close()
    state = stub_state(sglang_stub)
    assert state["last_pause"] == {"mode": "retract"} and state["tokens_while_paused"] == 0
