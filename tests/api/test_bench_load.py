"""The gateway bench's loaders against real servers: statuses counted apart, paths numbered.

Also the stand-in's chat route, which LiteLLM's chat mode is measured through.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from inference.stub_server import StubConfig, create_app, launch
from rlgate.bench.load import load
from rlgate.stack import free_port, stop, wait_healthy

LOADERS = ["python", pytest.param("wrk", marks=pytest.mark.wrk)]


class Recorder(BaseHTTPRequestHandler):
    """Answers every third request 429, the others 200 with a choice; records each path."""

    protocol_version = "HTTP/1.1"  # keep-alive, as the loaders use it
    paths: list[str] = []
    ok = 0  # 200s sent: the loaders may see fewer (wrk stops at its deadline), never more
    lock = threading.Lock()

    def do_POST(self) -> None:  # http.server calls it by this name
        self.rfile.read(int(self.headers["Content-Length"]))
        with self.lock:
            self.paths.append(self.path)
            status = 429 if len(self.paths) % 3 == 0 else 200
            Recorder.ok += status == 200
        body = json.dumps({"choices": [{"index": 0}]}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[str]:
    Recorder.paths, Recorder.ok = [], 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("loader", LOADERS)
def test_each_request_gets_its_own_path_and_429s_are_not_throughput(
    recorder: str, loader: str
) -> None:
    target = (recorder, "/episodes/{n}/v1/chat/completions", {"messages": []}, {})
    m = load(target, 4, 1.0, loader, warmup=1.0)
    paths = Recorder.paths[1:]  # the first: the warm-up request
    assert re.fullmatch(r"/episodes/warm-\w+/v1/chat/completions", Recorder.paths[0])
    assert m["answers"] >= 3 and m["answers"] <= len(paths)
    assert len(set(paths)) == len(paths)  # a fresh episode per request
    again = load(target, 4, 1.0, loader, warmup=0.0)  # and per load: no id comes back
    assert again["answers"] > 0 and len(set(Recorder.paths)) == len(Recorder.paths)
    assert all(re.fullmatch(r"/episodes/[\w-]+/v1/chat/completions", p) for p in paths)
    assert m["status_429"] >= 1
    assert m["requests"] == m["statuses"]["200"] == m["answers"] - m["status_429"]
    assert m["errors"] == m["status_429"] and m["status_5xx"] == 0
    # the warm-up's 2xx are counted apart (the bench's storage check adds them back)
    assert m["warm_2xx"] > 0 and m["warm_ok"] == 1
    assert m["warm_ok"] + m["warm_2xx"] + m["requests"] <= Recorder.ok


@pytest.mark.integration
@pytest.mark.wrk
def test_wrk_against_a_full_stub_counts_no_throughput(tmp_path) -> None:
    port = free_port()
    proc = launch("vllm", port, extra=["--max-running", "0"], log=tmp_path / "stub.log")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        m = load((url, "/v1/completions", {"prompt": [1, 2]}, {}), 8, 1.0, "wrk")
    finally:
        stop(proc)
    assert m["answers"] > 0 and m["status_429"] == m["answers"]
    assert m["requests"] == 0 and m["rps"] == 0.0 and m["warm_ok"] == m["warm_2xx"] == 0


async def test_stub_chat_route_answers_without_a_tokenizer() -> None:
    app = create_app(StubConfig(output_tokens=5))
    body = {
        "model": "stub-model",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "max_tokens": 3,
    }
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://s") as c:
        plain = (await c.post("/v1/chat/completions", json=body)).json()
        async with c.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
            lines = [ln async for ln in r.aiter_lines() if ln.startswith("data: ")]
        empty = await c.post("/v1/chat/completions", json={"messages": []})
    assert plain["object"] == "chat.completion"
    assert plain["choices"][0]["message"]["role"] == "assistant"
    assert len(plain["choices"][0]["message"]["content"].split()) == 3  # max_tokens caps it
    assert plain["usage"]["completion_tokens"] == 3
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert lines[-1] == "data: [DONE]" and len(chunks) == 3
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert empty.status_code == 400
