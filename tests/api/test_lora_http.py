"""LoRA adapters through the HTTP backends, against the STAND-IN servers (`inference.stub_server`).

The stand-ins are not vLLM or SGLang: they speak the runtime LoRA API of
each (vLLM's `/v1/load_lora_adapter` and a request's `model`; SGLang's
`/load_lora_adapter` and a request's `lora_path`), written from their
source, and their tokens depend on the adapter a request names
(`adapter_salt`). These tests check what rlgate sends and when: payloads,
per-adapter versions, the swap order of one adapter, routing in a replica
set. The real numerics (logprobs of base + adapter) are checked on a real
vLLM CPU server in tests/integration/test_vllm_lora.py; SGLang is not run
(it needs CUDA).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from inference.backend import AdapterBackend, BackendError
from inference.http_backend import HttpBackend
from inference.http_common import HttpBackendConfig
from inference.replicas import ReplicaConfig, ReplicaSet
from inference.sglang_http import SGLangBackend
from inference.stub_server import StubConfig, StubState, adapter_salt, launch
from inference.types import DRAIN, GenerateRequest, SamplingParams
from inference.vllm_http import VLLMBackend
from rlgate.stack import free_port, stop, wait_healthy

pytestmark = pytest.mark.integration

PROMPT = [5, 6, 7, 8]
KINDS: dict[str, type[HttpBackend]] = {"vllm": VLLMBackend, "sglang": SGLangBackend}


def expected(flavor: str, n: int, adapter: tuple[str, Path] | None = None) -> list[int]:
    """The stand-in's tokens for PROMPT by its own rule, with `adapter` (name, dir) or none."""
    state = StubState(StubConfig(flavor=flavor))
    salt = adapter_salt(adapter[0], str(adapter[1].resolve())) if adapter else 0
    return [state.token(PROMPT, i, salt)[0] for i in range(n)]


def adapter_dir(root: Path, name: str) -> Path:
    """A directory shaped like peft's `save_pretrained` output (the stand-in reads no weights)."""
    path = root / name
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    (path / "adapter_model.safetensors").write_bytes(b"\0" * 8)
    return path


def distinct_adapters(root: Path, runs: list[str]) -> list[Path]:
    """One adapter directory per run whose stand-in tokens differ from each other's and the
    base model's: the salt is a hash of run name and path, taken modulo the token span, so
    two could collide (about 2% of tmp paths for three)."""
    cfg = StubConfig()
    span = cfg.vocab_size - cfg.token_base
    for attempt in range(100):
        paths = [root / f"{run}-{attempt}" for run in runs]
        salts = {adapter_salt(r, str(p.resolve())) % span for r, p in zip(runs, paths, strict=True)}
        if len(salts) == len(runs) and 0 not in salts:
            return [adapter_dir(root, p.name) for p in paths]
    raise AssertionError("no adapter paths with distinct salts")


def serve(flavor: str, tmp_path: Path, *extra: str) -> Iterator[str]:
    port = free_port()
    proc = launch(flavor, port, extra=extra, log=tmp_path / f"{flavor}-{port}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout_s=60)
        yield url
    finally:
        stop(proc)


@pytest.fixture(params=sorted(KINDS))
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(flavor, url) of a stand-in: 300 ms before a request's first token, 100 ms per next one."""
    for url in serve(request.param, tmp_path, "--latency-ms=300", "--token-latency-ms=100"):
        yield request.param, url


def backend(flavor: str, url: str, **kw: float) -> HttpBackend:
    return KINDS[flavor](HttpBackendConfig(base_url=url, **kw))


def req(adapter: str | None = None, n: int = 4) -> GenerateRequest:
    return GenerateRequest(PROMPT, SamplingParams(max_tokens=n), adapter=adapter)


def stub_state(url: str) -> dict:
    return httpx.get(url + "/stub/state").json()


async def test_each_request_is_sampled_with_its_adapter_and_reports_its_version(
    server: tuple[str, str], tmp_path: Path
) -> None:
    flavor, url = server
    be = backend(flavor, url)
    assert isinstance(be, AdapterBackend)
    a, b = distinct_adapters(tmp_path, ["run-a", "run-b"])
    await be.load_adapter("run-a", a, 3)
    await be.load_adapter("run-b", b, 7)
    assert be.adapters == {"run-a": 3, "run-b": 7} and be.adapter_version("run-c") is None
    ra, rb, base = await asyncio.gather(
        be.generate(req("run-a")), be.generate(req("run-b")), be.generate(req())
    )
    assert ra.output_token_ids == expected(flavor, 4, ("run-a", a)) and ra.policy_version == 3
    assert rb.output_token_ids == expected(flavor, 4, ("run-b", b)) and rb.policy_version == 7
    assert base.output_token_ids == expected(flavor, 4) and base.policy_version == 0
    assert len({tuple(r.output_token_ids) for r in (ra, rb, base)}) == 3, "salts must differ"
    stream = be.start_stream(req("run-b"))
    assert [t async for t, _ in stream.tokens()] == rb.output_token_ids
    assert (await stream.result()).policy_version == 7
    assert stub_state(url)["adapters"] == {"run-a": str(a), "run-b": str(b)}
    await be.close()


async def test_reload_in_place_serves_the_new_weights_and_leaves_other_adapters(
    server: tuple[str, str], tmp_path: Path
) -> None:
    flavor, url = server
    be = backend(flavor, url)
    a1, a2, b = (adapter_dir(tmp_path, n) for n in ("a1", "a2", "b1"))
    await be.load_adapter("run-a", a1, 1)
    await be.load_adapter("run-b", b, 1)
    before = await be.generate(req("run-a"))
    await be.load_adapter("run-a", a2, 2)
    after, other = await asyncio.gather(be.generate(req("run-a")), be.generate(req("run-b")))
    assert before.output_token_ids == expected(flavor, 4, ("run-a", a1))
    assert after.output_token_ids == expected(flavor, 4, ("run-a", a2))
    assert after.policy_version == 2 and be.adapters == {"run-a": 2, "run-b": 1}
    assert other.output_token_ids == expected(flavor, 4, ("run-b", b))
    assert other.policy_version == 1
    assert stub_state(url)["adapters"]["run-a"] == str(a2)
    await be.close()


async def test_an_adapter_swap_drains_only_that_adapters_requests(
    server: tuple[str, str], tmp_path: Path
) -> None:
    """The drain-mode contract per adapter: A's in-flight request finishes on A v1; an A
    request arriving during the swap waits and gets v2; B's requests are neither held nor
    changed. (Keep mode pauses the whole server: tests/unit/test_http_backend_keep.py.)"""
    flavor, url = server
    be = backend(flavor, url)
    a1, a2, b = (adapter_dir(tmp_path, n) for n in ("a1", "a2", "b1"))
    await be.load_adapter("run-a", a1, 1)
    await be.load_adapter("run-b", b, 1)
    in_flight = asyncio.create_task(be.generate(req("run-a", n=8)))  # ~1 s on the stand-in
    await asyncio.sleep(0.05)  # admitted
    swap = asyncio.create_task(be.load_adapter("run-a", a2, 2, DRAIN))
    await asyncio.sleep(0.05)
    arriving = asyncio.create_task(be.generate(req("run-a")))
    other = await be.generate(req("run-b", n=1))  # ~0.3 s, while A is being swapped
    assert not swap.done() and not arriving.done(), "A's swap waits for A's in-flight request"
    assert other.policy_version == 1
    old = await in_flight
    await swap
    new = await arriving
    assert old.policy_version == 1 and old.output_token_ids == expected(flavor, 8, ("run-a", a1))
    assert new.policy_version == 2 and new.output_token_ids == expected(flavor, 4, ("run-a", a2))
    await be.close()


async def test_unload_drops_the_adapter_and_later_requests_fail(
    server: tuple[str, str], tmp_path: Path
) -> None:
    flavor, url = server
    be = backend(flavor, url)
    await be.load_adapter("run-a", adapter_dir(tmp_path, "a1"), 1)
    await be.unload_adapter("run-a")
    assert be.adapter_version("run-a") is None and stub_state(url)["adapters"] == {}
    with pytest.raises(BackendError, match="not loaded"):
        await be.generate(req("run-a"))
    with pytest.raises(BackendError, match="not loaded"):
        await be.start_stream(req("run-a")).result()
    with pytest.raises(BackendError, match="not loaded"):
        await be.unload_adapter("run-a")
    assert (await be.generate(req())).output_token_ids == expected(flavor, 4)
    await be.close()


async def test_a_directory_that_is_not_an_adapter_is_refused_before_the_server_is_asked(
    server: tuple[str, str], tmp_path: Path
) -> None:
    flavor, url = server
    be = backend(flavor, url)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(BackendError, match="not a PEFT adapter directory"):
        await be.load_adapter("run-a", empty, 1)
    assert stub_state(url)["adapter_loads"] == 0 and be.adapters == {}
    await be.close()


async def test_sglang_refusing_a_load_is_a_backend_error_and_nothing_is_recorded(
    tmp_path: Path,
) -> None:
    """SGLang refuses a name it already serves (here loaded behind the backend's back)."""
    for url in serve("sglang", tmp_path):
        be = backend("sglang", url)
        path = adapter_dir(tmp_path, "a1")
        body = {"lora_name": "run-a", "lora_path": str(path)}
        assert httpx.post(url + "/load_lora_adapter", json=body).status_code == 200
        with pytest.raises(BackendError, match="already loaded"):
            await be.load_adapter("run-a", path, 1)
        assert be.adapters == {}
        await be.close()


def test_request_bodies_name_the_adapter() -> None:
    from inference.sglang_http import generate_payload
    from inference.vllm_http import completion_body

    assert completion_body("base", req("run-a"), False)["model"] == "run-a"
    assert completion_body("base", req(), False)["model"] == "base"
    assert generate_payload(req("run-a"), False)["lora_path"] == "run-a"
    assert "lora_path" not in generate_payload(req(), False)


async def test_vllm_without_the_lora_api_says_how_to_start_it(tmp_path: Path) -> None:
    for url in serve("vllm", tmp_path, "--no-lora"):
        be = backend("vllm", url)
        with pytest.raises(BackendError, match="--enable-lora"):
            await be.load_adapter("run-a", adapter_dir(tmp_path, "a1"), 1)
        assert be.adapters == {}
        await be.close()


async def test_replica_set_rolls_adapters_and_routes_only_to_replicas_that_have_them(
    tmp_path: Path,
) -> None:
    for i in range(2):
        (tmp_path / f"r{i}").mkdir()
    servers = [serve("vllm", tmp_path / f"r{i}") for i in range(2)]
    urls = [next(s) for s in servers]
    try:
        backends = [backend("vllm", u) for u in urls]
        rs = ReplicaSet(
            [(f"r{i}", b, u) for i, (b, u) in enumerate(zip(backends, urls, strict=True))],
            ReplicaConfig(health_interval_s=60),
        )
        a1, a2, b = (adapter_dir(tmp_path, n) for n in ("a1", "a2", "b1"))
        await rs.load_adapter("run-a", a1, 1)
        assert [be.adapter_version("run-a") for be in backends] == [1, 1]
        assert rs.adapter_version("run-a") == 1
        await rs.load_adapter("run-a", a2, 2)
        results = await asyncio.gather(*(rs.generate(req("run-a")) for _ in range(6)))
        assert {r.policy_version for r in results} == {2}
        assert all(r.output_token_ids == expected("vllm", 4, ("run-a", a2)) for r in results)
        # an adapter on one replica only: its requests go there, nowhere else
        await backends[1].load_adapter("run-b", b, 5)
        counts = [stub_state(u)["requests"] for u in urls]
        got = await asyncio.gather(*(rs.generate(req("run-b")) for _ in range(4)))
        assert {r.policy_version for r in got} == {5}
        assert [stub_state(u)["requests"] - c for u, c in zip(urls, counts, strict=True)] == [0, 4]
        await rs.unload_adapter("run-a")
        assert rs.adapter_version("run-a") is None
        assert all("run-a" not in stub_state(u)["adapters"] for u in urls)
        with pytest.raises(BackendError, match="not loaded"):
            await rs.generate(req("run-a"))
        await rs.close()
    finally:
        for s in servers:
            s.close()  # runs the generator's finally: stops the stand-in
