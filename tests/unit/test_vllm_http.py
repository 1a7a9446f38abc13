"""VLLMBackend against an in-process stand-in transport (no vLLM): request shape, SSE
parsing, error mapping, the swap ordering (drain and keep: pause, reload, label,
resume) and the weights labels that give each token its version.

The stand-in answers the subset of vLLM's HTTP API the backend uses, as vLLM
0.32 does (checked against the real server in tests/integration/test_vllm.py and
tests/integration/test_vllm_keep_swap.py).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from inference.backend import BackendError, BackendOverloaded
from inference.http_common import HttpBackendConfig, check_status
from inference.types import DRAIN, KEEP, GenerateRequest, SamplingParams, SwapPolicy
from inference.vllm_http import (
    ServerLabel,
    VLLMBackend,
    completion_body,
    generate_body,
    lane_starts,
    server_command,
)


class FakeVLLM:
    """Records calls; generations return `tokens` with logprob -0.5 each; can be held.

    Every token carries the label set by `/update_weight_version` when the fake sampled
    it (`weight_versions`, as vLLM gives them); `/weight_info` reads the label back.
    """

    def __init__(self, tokens: list[int] | None = None) -> None:
        self.tokens = tokens or [5, 6, 7]
        self.calls: list[str] = []
        self.bodies: list[dict] = []
        self.params: list[dict] = []  # query parameters of each /pause
        self.labels: list[str] = []  # every label set, in order
        self.label = "default"
        self.release = asyncio.Event()
        self.release.set()
        self.status = 200
        self.error_body = ""

    def spans(self, labels: list[str]) -> list[dict]:
        out: list[dict] = []
        for i, label in enumerate(labels):
            if out and out[-1]["version"] == label:
                out[-1]["end"] = i + 1
            else:
                out.append({"version": label, "start": i, "end": i + 1})
        return out

    async def handler(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 512}]})
        if path == "/health":
            return httpx.Response(200)
        self.calls.append(path)
        if path == "/weight_info":
            return httpx.Response(200, json={"weight_version": self.label})
        if path == "/update_weight_version":
            self.label = json.loads(request.content)["new_version"]
            self.labels.append(self.label)
            return httpx.Response(200, json={"success": True})
        if path == "/pause":
            self.params.append(dict(request.url.params))
        if path != "/inference/v1/generate":
            return httpx.Response(200, json={})
        body = json.loads(request.content)
        self.bodies.append(body)
        if self.status != 200:
            return httpx.Response(self.status, text=self.error_body)
        labels = [self.label]  # the first token is sampled at once, the rest once released
        await self.release.wait()
        labels += [self.label] * (len(self.tokens) - 1)
        self.calls.append("completion-done")
        if body["stream"]:
            events = [
                {"choices": [{"token_ids": [t], "logprobs": {"content": [{"logprob": -0.5}]}}]}
                for t in self.tokens
            ]
            last = events[-1]["choices"][0]
            last["finish_reason"], last["weight_versions"] = "length", self.spans(labels)
            text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
            return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})
        choice = {
            "token_ids": self.tokens,
            "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in self.tokens]},
            "finish_reason": "stop",
            "weight_versions": self.spans(labels),
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
    body = generate_body("m", REQ, stream=False)
    assert body["token_ids"] == [1, 2, 3] and body["model"] == "m" and body["stream"] is False
    sp = body["sampling_params"]
    assert sp["max_tokens"] == 4 and sp["logprobs"] == 0
    assert (sp["temperature"], sp["top_p"], sp["seed"]) == (0.7, 0.9, 11)
    assert sp["stop_token_ids"] == [2] and sp["ignore_eos"] is True
    assert "stop" not in sp  # no stop strings asked for
    assert sp["top_k"] == 0  # off, whatever the model's generation_config says
    params = SamplingParams(top_k=5, stop=("\n\n",))
    sp = generate_body("m", GenerateRequest([1], params, adapter="a"), stream=True)
    assert sp["model"] == "a" and sp["sampling_params"]["top_k"] == 5
    assert sp["sampling_params"]["stop"] == ["\n\n"]
    # /v1/completions takes the same sampling, flat
    flat = completion_body("m", REQ, stream=False)
    assert flat["prompt"] == [1, 2, 3] and flat["return_token_ids"] is True
    same = generate_body("m", REQ, stream=False)["sampling_params"]
    assert {k: flat[k] for k in same} == same


def test_server_command_enables_the_token_api() -> None:
    from inference.launch import ServerConfig

    cmd = server_command(ServerConfig(kind="vllm", model_dir=Path("m"), python=Path("py")))
    assert "--enable-scale-out" in cmd
    assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"


async def test_generate_and_stream_return_ids_logprobs_and_version() -> None:
    fake = FakeVLLM()
    be = _backend(fake)
    r = await be.generate(REQ)
    assert fake.labels == [ServerLabel(0).encode()]  # labelled once, before the first call
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
    await be.server_info()  # labels the unlabelled server with this client's v0
    assert ServerLabel.decode(fake.label) == ServerLabel(0, {})
    fake.calls.clear()
    fake.release.clear()  # hold the next completion in flight
    first = asyncio.create_task(be.generate(REQ))
    while "/inference/v1/generate" not in fake.calls:
        await asyncio.sleep(0.01)
    swap = asyncio.create_task(be.load_weights(tmp_path, 1, DRAIN))
    await asyncio.sleep(0.05)
    later = asyncio.create_task(be.generate(REQ))  # arrives during the swap: waits at the gate
    await asyncio.sleep(0.05)
    assert "/pause" not in fake.calls  # the in-flight request is not cut off
    assert fake.calls.count("/inference/v1/generate") == 1  # the later request has not been sent
    fake.release.set()
    await swap
    r1, r2 = await first, await later
    assert r1.policy_version == 0 and r2.policy_version == 1
    i = fake.calls.index
    assert i("completion-done") < i("/pause") < i("/collective_rpc") < i("/resume")
    assert fake.calls.index("/resume") < len(fake.calls) - 1 - fake.calls[::-1].index(
        "/inference/v1/generate"
    )
    assert be.version == 1
    assert fake.params == [{"mode": "wait", "clear_cache": "true"}]
    assert i("/collective_rpc") < i("/update_weight_version") < i("/resume")
    assert ServerLabel.decode(fake.label) == ServerLabel(1, {})
    assert r2.version_starts == ()  # a drained swap: one version per completion
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
    while fake.calls.count("/inference/v1/generate") < 2:
        await asyncio.sleep(0.01)
    await be.load_weights(tmp_path, 1, DRAIN)
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
    while "/inference/v1/generate" not in fake.calls:
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


@pytest.mark.parametrize("clear_kv", [True, False])
async def test_keep_swap_pauses_in_place_labels_and_the_server_spans_give_versions(
    tmp_path: Path, clear_kv: bool
) -> None:
    """A keep-mode swap does not wait for the requests in flight: it pauses with
    mode=keep, reloads, labels the new weights while still paused, resumes; the held
    request's tokens sampled after the label report the new version from that index."""
    (tmp_path / "model.safetensors").write_bytes(b"x")
    fake = FakeVLLM(tokens=[5, 6, 7, 8])
    be = _backend(fake)
    await be.load_weights(tmp_path, 3, SwapPolicy("keep", clear_kv))  # labels v3
    fake.release.clear()  # the next generation samples one token, then waits
    stream = be.start_stream(REQ)
    plain = asyncio.create_task(be.generate(REQ))
    while fake.calls.count("/inference/v1/generate") < 2:
        await asyncio.sleep(0.01)
    await be.load_weights(tmp_path, 4, SwapPolicy("keep", clear_kv))  # while both are held
    assert "completion-done" not in fake.calls  # the swap waited for neither
    clear = "true" if clear_kv else "false"
    assert fake.params[-1] == {"mode": "keep", "clear_cache": clear}
    calls = fake.calls[fake.calls.index("/pause", 5) :]
    assert calls[:5] == [
        "/pause", "/collective_rpc", "/weight_info", "/update_weight_version", "/resume"
    ]  # fmt: skip
    assert [ServerLabel.decode(x) for x in fake.labels] == [ServerLabel(3), ServerLabel(4)]
    fake.release.set()
    for result in (await stream.result(), await plain):
        assert result.version_starts == ((0, 3), (1, 4)) and result.policy_version == 3
    assert (await be.generate(REQ)).version_starts == ()  # all by v4
    assert (await be.generate(REQ)).policy_version == 4
    await be.close()


async def test_the_label_keeps_other_clients_lanes_and_adapters_swap_draining(
    tmp_path: Path,
) -> None:
    """One label serves every client of a server: a client rewrites only its own lanes,
    and a request reads the version of its own lane (base, or its adapter). An adapter
    is replaced draining even when keep is asked (vLLM keeps a running request on the
    adapter it was admitted with), without pausing the server for the other lanes."""
    for d in ("v2", "v3"):
        (tmp_path / d).mkdir()
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            (tmp_path / d / f).write_text("{}")
    fake = FakeVLLM()
    fake.label = ServerLabel(0, {"other-run": 7}).encode()  # another process's adapter
    be = _backend(fake)
    await be.load_adapter("a", tmp_path / "v2", 2)  # first load: labelled at once
    assert ServerLabel.decode(fake.label) == ServerLabel(0, {"a": 2, "other-run": 7})
    fake.release.clear()
    on_a = be.start_stream(GenerateRequest([1, 2], adapter="a"))
    on_base = be.start_stream(GenerateRequest([1, 2]))
    while fake.calls.count("/inference/v1/generate") < 2:
        await asyncio.sleep(0.01)
    swap = asyncio.create_task(be.load_adapter("a", tmp_path / "v3", 3, KEEP))
    await asyncio.sleep(0.05)
    assert not swap.done() and "/v1/load_lora_adapter" not in fake.calls[-3:]  # draining
    fake.release.set()
    await swap
    assert ServerLabel.decode(fake.label) == ServerLabel(0, {"a": 3, "other-run": 7})
    assert "/pause" not in fake.calls  # the other lanes never paused
    ra, rb = await on_a.result(), await on_base.result()
    assert (ra.policy_version, ra.version_starts) == (2, ())  # finished on v2
    assert (rb.policy_version, rb.version_starts) == (0, ())  # the label changed, not its lane
    assert (await be.generate(GenerateRequest([1], adapter="a"))).policy_version == 3
    await be.close()


def test_label_round_trip_and_lane_starts() -> None:
    label = ServerLabel(4, {"b": 1, "a": 9})
    assert label.encode() == '{"base":4,"lora":{"a":9,"b":1}}'
    assert ServerLabel.decode(label.encode()) == label
    for foreign in ("default", "4", "{not json", '{"base":"x"}', None):
        assert ServerLabel.decode(foreign) is None
    spans = [
        {"version": ServerLabel(4, {"a": 1}).encode(), "start": 0, "end": 5},
        {"version": ServerLabel(5, {"a": 1}).encode(), "start": 5, "end": 9},
    ]
    assert lane_starts(spans, None, n_tokens=9) == ((0, 4), (5, 5))
    assert lane_starts(spans, "a", n_tokens=9) == ((0, 1),)
    assert lane_starts(spans, "zz", n_tokens=9) is None  # a lane it lacks
    assert lane_starts([{"version": "default", "start": 0, "end": 9}], None, 9) is None
    assert lane_starts(spans[::-1], None, n_tokens=9) is None  # going backwards
    assert lane_starts(None, None, 3) is None and lane_starts([], None, 3) is None


async def test_a_label_another_run_left_is_rewritten_before_the_first_call() -> None:
    """A server whose label gives this client's lane another version (a run it served
    before) is relabelled with the client's version, so no token of ours carries it."""
    fake = FakeVLLM()
    fake.label = ServerLabel(5, {"other": 2}).encode()
    be = _backend(fake)
    await be.server_info()
    assert ServerLabel.decode(fake.label) == ServerLabel(0, {"other": 2})
    fake.labels.clear()
    await be.server_info()  # once per client
    assert fake.labels == []
    await be.close()


def test_a_label_ahead_of_this_client_is_another_process_reload() -> None:
    """Under the swap barrier another process reloads the server and this client adopts the
    version after the resume: its request's later tokens carry the newer label, and count."""
    spans = [
        {"version": ServerLabel(0).encode(), "start": 0, "end": 3},
        {"version": ServerLabel(1).encode(), "start": 3, "end": 8},
    ]
    assert lane_starts(spans, None, n_tokens=8) == ((0, 0), (3, 1))
