"""The stand-in server's pauses and per-token labels (`inference.stub_server`), over real HTTP.

A stand-in process on loopback, driven with httpx: a keep pause freezes
streams between two tokens and no token is sampled inside it; a wait pause
lets them finish; `/inference/v1/generate` answers in vLLM 0.32's
token-in/token-out shape with `weight_versions` telling which label sampled
each token; SGLang's `in_place` pause refuses a cache flush while requests
run. Most other tests and `rlgate bench swap` rely on these semantics.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from inference.stub_server import StubConfig, StubState, launch
from rlgate.stack import free_port, stop, wait_healthy

PROMPT = [3, 1, 4, 1, 5]


def tokens_of(version: int, n: int, prompt: list[int] = PROMPT) -> list[int]:
    """The stand-in's tokens 0..n-1 for `prompt` at weights `version` (its own rule)."""
    state = StubState(StubConfig(version=version))
    return [state.token(prompt, i)[0] for i in range(n)]


def serve(tmp_path: Path, flavor: str, *extra: str, output_tokens: int = 64) -> Iterator[str]:
    """The stand-in server of `flavor` (`extra`: more of its options) on a free port, until
    the generator is closed."""
    port = free_port()
    proc = launch(flavor, port, output_tokens=output_tokens, extra=extra, log=tmp_path / "stub.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout_s=60)
        yield url
    finally:
        stop(proc)


@pytest.fixture
def vllm_stub(tmp_path: Path) -> Iterator[str]:
    yield from serve(tmp_path, "vllm", "--token-latency-ms=40")


@pytest.fixture
def sglang_stub(tmp_path: Path) -> Iterator[str]:
    yield from serve(tmp_path, "sglang", "--token-latency-ms=40")


def generate_body(n: int, stream: bool) -> dict[str, Any]:
    params = {"max_tokens": n, "temperature": 1.0, "logprobs": 0}
    return {"token_ids": PROMPT, "sampling_params": params, "model": "stub-model", "stream": stream}


async def events(client: httpx.AsyncClient, path: str, body: dict) -> AsyncIterator[Any]:
    """The JSON events of one SSE answer, then the string "[DONE]"."""
    async with client.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                yield data if data == "[DONE]" else json.loads(data)


async def state(client: httpx.AsyncClient) -> dict[str, Any]:
    return (await client.get("/stub/state")).json()


async def test_generate_answers_in_vllm_token_in_token_out_shape(vllm_stub: str) -> None:
    async with httpx.AsyncClient(base_url=vllm_stub, timeout=30) as client:
        body = (await client.post("/inference/v1/generate", json=generate_body(5, False))).json()
        (choice,) = body["choices"]
        assert body["request_id"] and choice["index"] == 0
        assert choice["token_ids"] == tokens_of(0, 5) and choice["finish_reason"] == "length"
        content = choice["logprobs"]["content"]
        assert [c["token_id"] for c in content] == choice["token_ids"]
        assert all(c["logprob"] < 0 for c in content)
        assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": 5}]

        chunks = [e async for e in events(client, "/inference/v1/generate", generate_body(3, True))]
        assert chunks[-1] == "[DONE]"
        choices = [c["choices"][0] for c in chunks[:-1]]
        assert [c["token_ids"] for c in choices] == [[t] for t in tokens_of(0, 3)]
        assert [c["finish_reason"] for c in choices] == [None, None, "length"]
        assert [c.get("weight_versions") for c in choices[:-1]] == [None, None]
        assert choices[-1]["weight_versions"] == [{"version": "default", "start": 0, "end": 3}]


async def test_keep_pause_freezes_streams_and_labels_each_token(vllm_stub: str) -> None:
    """Tokens before the pause carry the old label and come from the old weights, every
    token after it the new ones; nothing is sampled while paused."""
    n = 12
    async with httpx.AsyncClient(base_url=vllm_stub, timeout=30) as client:
        got: list[int] = []
        final: dict[str, Any] = {}
        two = asyncio.Event()

        async def read() -> None:
            async for event in events(client, "/inference/v1/generate", generate_body(n, True)):
                if event == "[DONE]":
                    return
                choice = event["choices"][0]
                got.extend(choice["token_ids"])
                final.update(choice)
                if len(got) >= 2:
                    two.set()

        reader = asyncio.create_task(read())
        await asyncio.wait_for(two.wait(), 30)
        await client.post("/pause", params={"mode": "keep", "clear_cache": "true"})
        paused = await state(client)
        assert paused["pause"] == {"mode": "keep", "clear_cache": True}
        assert (await client.get("/is_paused")).json() == {"is_paused": True}
        await asyncio.sleep(0.5)  # ~12 token latencies: an unfrozen stream would have ended
        assert not reader.done() and (await state(client))["in_flight"] == 1
        at_pause = len(got)
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": "/ckpt/v1"}}
        assert (await client.post("/collective_rpc", json=rpc)).status_code == 200
        answer = await client.post("/update_weight_version", json={"new_version": "1"})
        assert answer.json() == {"success": True, "new_version": "1"}
        assert (await client.get("/weight_info")).json() == {"weight_version": "1"}
        assert len(got) == at_pause  # still frozen through the reload
        await client.post("/resume")
        await asyncio.wait_for(reader, 30)
        after = await state(client)
    assert len(got) == n and 2 <= at_pause < n
    assert got == tokens_of(0, n)[:at_pause] + tokens_of(1, n)[at_pause:]
    assert final["weight_versions"] == [
        {"version": "default", "start": 0, "end": at_pause},
        {"version": "1", "start": at_pause, "end": n},
    ]
    assert after["tokens_while_paused"] == 0 and after["pause"] is None
    assert after["weight_version"] == "1" and after["version"] == 1


async def test_wait_pause_lets_streams_finish_and_holds_new_requests(vllm_stub: str) -> None:
    async with httpx.AsyncClient(base_url=vllm_stub, timeout=30) as client:
        first = asyncio.Event()
        got: list[int] = []

        async def read() -> None:
            body = {"prompt": PROMPT, "max_tokens": 6, "stream": True, "return_token_ids": True}
            async for event in events(client, "/v1/completions", body):
                if event != "[DONE]":
                    got.extend(event["choices"][0]["token_ids"])
                    first.set()

        reader = asyncio.create_task(read())
        await asyncio.wait_for(first.wait(), 30)
        await client.post("/pause", params={"mode": "wait"})
        await asyncio.wait_for(reader, 30)  # the stream in flight goes on to its end
        assert got == tokens_of(0, 6)
        late = asyncio.create_task(
            client.post("/inference/v1/generate", json=generate_body(2, False))
        )
        await asyncio.sleep(0.3)
        assert not late.done(), "a new request waits for the resume"
        assert (await state(client))["pause"] == {"mode": "wait", "clear_cache": True}
        await client.post("/resume")
        assert (await late).json()["choices"][0]["token_ids"] == tokens_of(0, 2)
        assert (await client.post("/pause", params={"mode": "abort"})).status_code == 400


async def test_sglang_in_place_pause_refuses_a_cache_flush_while_requests_run(
    sglang_stub: str,
) -> None:
    async with httpx.AsyncClient(base_url=sglang_stub, timeout=30) as client:
        first = asyncio.Event()
        got: list[int] = []

        async def read() -> None:
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8}, "stream": True}
            async for event in events(client, "/generate", body):
                if event != "[DONE]":
                    got[:] = event["output_ids"]  # cumulative, as SGLang streams
                    first.set()

        reader = asyncio.create_task(read())
        await asyncio.wait_for(first.wait(), 30)
        await client.post("/pause_generation", json={"mode": "in_place"})
        assert (await state(client))["pause"] == {"mode": "in_place"}
        update = {"model_path": "/ckpt/v1", "weight_version": "1"}
        refused = await client.post("/update_weights_from_disk", json=update)
        assert refused.status_code == 400 and refused.json()["success"] is False
        kept = await client.post("/update_weights_from_disk", json={**update, "flush_cache": False})
        assert kept.json()["success"] is True
        at_pause = len(got)
        await client.post("/continue_generation", json={})
        await asyncio.wait_for(reader, 30)
        assert got == tokens_of(0, 8)[:at_pause] + tokens_of(1, 8)[at_pause:]
        assert 1 <= at_pause < 8 and (await state(client))["tokens_while_paused"] == 0
        await client.post("/pause_generation", json={"mode": "retract"})
        assert (await state(client))["pause"] == {"mode": "retract"}
        await client.post("/continue_generation", json={})
        assert (await client.post("/pause_generation", json={"mode": "abort"})).status_code == 400
