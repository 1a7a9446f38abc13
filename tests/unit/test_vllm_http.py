"""VLLMBackend against an in-process stand-in transport (no vLLM): request shape, SSE
parsing, error mapping, and the swap ordering (drain, pause, reload, resume).

The stand-in answers the subset of vLLM's HTTP API the backend uses, as vLLM
0.32 does (checked against the real server in tests/integration/test_vllm.py).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from inference.backend import BackendError, BackendOverloaded
from inference.http_common import HttpBackendConfig, check_status
from inference.types import GenerateRequest, SamplingParams
from inference.vllm_http import VLLMBackend, completion_body


class FakeVLLM:
    """Records calls; completions return `tokens` with logprob -0.5 each; can be held."""

    def __init__(self, tokens: list[int] | None = None) -> None:
        self.tokens = tokens or [5, 6, 7]
        self.calls: list[str] = []
        self.bodies: list[dict] = []
        self.release = asyncio.Event()
        self.release.set()
        self.status = 200
        self.error_body = ""

    async def handler(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 512}]})
        if path == "/health":
            return httpx.Response(200)
        self.calls.append(path)
        if path != "/v1/completions":
            return httpx.Response(200, json={})
        body = json.loads(request.content)
        self.bodies.append(body)
        if self.status != 200:
            return httpx.Response(self.status, text=self.error_body)
        await self.release.wait()
        self.calls.append("completion-done")
        if body["stream"]:
            events = [
                {"choices": [{"token_ids": [t], "logprobs": {"token_logprobs": [-0.5]}}]}
                for t in self.tokens
            ]
            events[-1]["choices"][0]["finish_reason"] = "length"
            text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
            return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})
        choice = {
            "token_ids": self.tokens,
            "logprobs": {"token_logprobs": [-0.5] * len(self.tokens)},
            "finish_reason": "stop",
        }
        return httpx.Response(200, json={"choices": [choice]})


def _backend(fake: FakeVLLM) -> VLLMBackend:
    return VLLMBackend(
        HttpBackendConfig(base_url="http://vllm.test", drain_timeout_s=5),
        transport=httpx.MockTransport(fake.handler),
    )


REQ = GenerateRequest(
    [1, 2, 3],
    SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9, seed=11, stop_token_ids=(2,)),
)


def test_body_maps_sampling_params_one_to_one() -> None:
    body = completion_body("m", REQ, stream=False)
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 4
    assert (body["temperature"], body["top_p"], body["seed"]) == (0.7, 0.9, 11)
    assert body["return_token_ids"] is True and body["logprobs"] == 0
    assert body["stop_token_ids"] == [2] and body["ignore_eos"] is True
    assert "stop" not in body  # no stop strings asked for
    assert body["top_k"] == 0  # off, whatever the model's generation_config says
    params = SamplingParams(top_k=5)
    assert completion_body("m", GenerateRequest([1], params), stream=False)["top_k"] == 5


async def test_generate_and_stream_return_ids_logprobs_and_version() -> None:
    fake = FakeVLLM()
    be = _backend(fake)
    r = await be.generate(REQ)
    assert (r.output_token_ids, r.output_logprobs, r.finish_reason) == (
        [5, 6, 7],
        [-0.5] * 3,
        "stop",
    )
    stream = be.start_stream(REQ)
    got = [t async for t, _ in stream.tokens()]
    res = await stream.result()
    assert got == res.output_token_ids == [5, 6, 7] and res.finish_reason == "length"
    assert res.policy_version == 0
    await be.close()


@pytest.mark.parametrize(
    ("status", "body", "error"),
    [
        (429, "slow down", BackendOverloaded),
        (503, "The request queue is full", BackendOverloaded),
        (500, "EngineCore died", BackendError),
        (400, "bad", BackendError),
    ],
)
async def test_http_errors_map_to_backend_errors(status, body, error) -> None:
    fake = FakeVLLM()
    fake.status, fake.error_body = status, body
    be = _backend(fake)
    with pytest.raises(error):
        await be.generate(REQ)
    stream = be.start_stream(REQ)
    with pytest.raises(error):
        await stream.result()
    await be.close()


async def test_connection_refused_is_backend_error() -> None:
    be = VLLMBackend(HttpBackendConfig(base_url="http://127.0.0.1:9", connect_timeout_s=1))
    with pytest.raises(BackendError) as info:
        await be.generate(REQ)
    assert not isinstance(info.value, BackendOverloaded)
    assert await be.health() is False
    await be.close()


def test_check_status_passes_2xx() -> None:
    check_status(200, "", "x")


async def test_swap_drains_in_flight_then_reloads_and_new_requests_wait(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"x")
    fake = FakeVLLM()
    be = _backend(fake)
    await be.server_info()
    fake.release.clear()  # hold the next completion in flight
    first = asyncio.create_task(be.generate(REQ))
    while "/v1/completions" not in fake.calls:
        await asyncio.sleep(0.01)
    swap = asyncio.create_task(be.load_weights(tmp_path, 1))
    await asyncio.sleep(0.05)
    later = asyncio.create_task(be.generate(REQ))  # arrives during the swap: waits at the gate
    await asyncio.sleep(0.05)
    assert "/pause" not in fake.calls  # the in-flight request is not cut off
    assert fake.calls.count("/v1/completions") == 1  # the later request has not been sent
    fake.release.set()
    await swap
    r1, r2 = await first, await later
    assert r1.policy_version == 0 and r2.policy_version == 1
    i = fake.calls.index
    assert i("completion-done") < i("/pause") < i("/collective_rpc") < i("/resume")
    assert fake.calls.index("/resume") < len(fake.calls) - 1 - fake.calls[::-1].index(
        "/v1/completions"
    )
    assert be.version == 1
    await be.close()


async def test_swap_refuses_a_directory_without_weights(tmp_path: Path) -> None:
    fake = FakeVLLM()
    be = _backend(fake)
    with pytest.raises(BackendError, match="safetensors"):
        await be.load_weights(tmp_path, 3)
    assert be.version == 0 and "/pause" not in fake.calls
    assert (await be.generate(REQ)).policy_version == 0  # the gate is open again
    await be.close()


async def test_swap_aborts_stragglers_after_the_drain_timeout(tmp_path: Path) -> None:
    """The drain-timeout policy of every HTTP backend (`inference.http_backend`): requests
    still running when the drain times out fail with BackendError, then the swap goes on."""
    (tmp_path / "model.safetensors").write_bytes(b"x")
    fake = FakeVLLM()
    be = VLLMBackend(
        HttpBackendConfig(base_url="http://vllm.test", drain_timeout_s=0.2),
        transport=httpx.MockTransport(fake.handler),
    )
    await be.server_info()
    fake.release.clear()  # both requests below hang until aborted
    stuck = asyncio.create_task(be.generate(REQ))
    stream = be.start_stream(REQ)
    while fake.calls.count("/v1/completions") < 2:
        await asyncio.sleep(0.01)
    await be.load_weights(tmp_path, 1)
    with pytest.raises(BackendError, match="drain timeout"):
        await stuck
    with pytest.raises(BackendError, match="drain timeout"):
        await stream.result()
    assert "completion-done" not in fake.calls  # neither got an answer from any version
    i = fake.calls.index
    assert i("/pause") < i("/collective_rpc") < i("/resume") and be.version == 1
    fake.release.set()
    assert (await be.generate(REQ)).policy_version == 1  # the gate is open again
    await be.close()


async def test_stream_cancel_keeps_the_version_it_was_admitted_on(tmp_path: Path) -> None:
    fake = FakeVLLM()
    be = _backend(fake)
    fake.release.clear()
    stream = be.start_stream(REQ)
    while "/v1/completions" not in fake.calls:
        await asyncio.sleep(0.01)
    stream.cancel()
    result = await stream.result()
    assert (result.finish_reason, result.output_token_ids, result.policy_version) == (
        "cancelled",
        [],
        0,
    )
    assert [t async for t, _ in stream.tokens()] == []
    await be.close()
