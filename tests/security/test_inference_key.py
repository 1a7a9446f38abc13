"""The gateway presents `RLGATE_INFERENCE_API_KEY` to its vLLM and SGLang servers.

The servers are `inference.stub_server` started with `--api-key`: it refuses
every call without the key (401) but `/health`, and counts the refusals. A real
gateway serving a run from it answers an agent's calls (streamed or not) only
because every call it makes, sampling and control alike, carries the key.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from rlgate.stack import free_port, stop

pytestmark = pytest.mark.integration

KEY = "inference-key-for-the-test"


def _stub(flavor: str, port: int, key: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "inference.stub_server", "--flavor", flavor]
    cmd += ["--port", str(port), "--output-tokens", "3", "--api-key", key]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the stub server did not start")


@pytest.fixture(params=["vllm", "sglang"])
def keyed_stub(request) -> Iterator[tuple[str, str]]:
    """(backend kind, URL) of a stand-in server that requires KEY."""
    port = free_port()
    proc = _stub(request.param, port, KEY)
    try:
        yield request.param, f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


def _state(url: str) -> dict:
    return httpx.get(url + "/stub/state", timeout=10).json()


def test_the_stub_refuses_calls_without_the_key(keyed_stub) -> None:
    kind, url = keyed_stub
    path = "/v1/models" if kind == "vllm" else "/get_model_info"
    assert httpx.get(url + path, timeout=10).status_code == 401
    wrong = httpx.get(url + path, headers={"Authorization": "Bearer nope"}, timeout=10)
    assert wrong.status_code == 401
    right = httpx.get(url + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert right.status_code == 200


def test_the_gateway_sends_the_key(gateway_launcher, tmp_path: Path, keyed_stub) -> None:
    kind, url = keyed_stub
    server = gateway_launcher(tmp_path / "data", inference_api_key=KEY)
    try:
        run = httpx.post(
            server.url + "/admin/v1/runs",
            json={"name": "keyed", "model": "tiny", "backend": kind, "replicas": [url]},
            headers=server.admin_headers(),
            timeout=120,
        )
        assert run.status_code == 201, run.text
        run = run.json()
        client = openai.OpenAI(base_url=run["base_url"], api_key=run["api_key"], max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        plain = client.chat.completions.create(model="keyed", messages=messages, max_tokens=3)
        chunks = list(
            client.chat.completions.create(
                model="keyed", messages=messages, max_tokens=3, stream=True
            )
        )
    finally:
        stop(server.proc)
    assert plain.choices[0].finish_reason is not None and chunks
    state = _state(url)
    assert state["requests"] >= 2
    assert state["refused"] == 0, state


def test_a_gateway_without_the_key_is_refused(gateway_launcher, tmp_path: Path, keyed_stub) -> None:
    kind, url = keyed_stub
    server = gateway_launcher(tmp_path / "data", inference_api_key="")
    try:
        resp = httpx.post(
            server.url + "/admin/v1/runs",
            json={"name": "unkeyed", "model": "tiny", "backend": kind, "replicas": [url]},
            headers=server.admin_headers(),
            timeout=120,
        )
        if resp.status_code == 201:  # registered: its calls are refused by the server
            created = resp.json()
            chat = httpx.post(
                created["base_url"] + "/chat/completions",
                json={"model": "unkeyed", "messages": [{"role": "user", "content": "hi"}]},
                headers={"Authorization": f"Bearer {created['api_key']}"},
                timeout=60,
            )
            assert chat.status_code >= 400
    finally:
        stop(server.proc)
    assert _state(url)["refused"] >= 1
