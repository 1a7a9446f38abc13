"""`rlgate up` on SIGTERM finishes the requests in flight, then exits and leaves nothing behind.

The tiny model answers in well under a second, too fast to aim a signal at. So the
requests are held in flight by their reader instead: the client reads through a small
receive buffer and stops reading once the answer has started. Until it reads on, the
gateway cannot finish sending (each token carries 20 top logprobs, so an answer is far
larger than the socket buffers). Then SIGTERM: the gateway must stop listening but keep
both answers going, and exit only after the client has read them to the end.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from rlgate.stack import free_port, stop, wait_healthy
from tests.procs import alive, children_of

pytestmark = pytest.mark.integration

ADMIN_KEY = "drain-admin"
PROMPT = [{"role": "user", "content": "tell me a long story"}]
# Long, large answers: seed 18 samples 655 tokens on the tiny model; 20 logprobs each.
LARGE = {"max_tokens": 900, "seed": 18, "logprobs": True, "top_logprobs": 20}


def stored_content(db: Path, completion_id: str) -> str:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        rows = conn.execute("SELECT content FROM completions WHERE id = ?", (completion_id,))
        return rows.fetchone()[0]
    finally:
        conn.close()


def slow_reader() -> httpx.Client:
    """A client whose connections receive through a 4 KiB buffer: what it does not read
    stays on the server's side."""
    options = [(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)]
    return httpx.Client(transport=httpx.HTTPTransport(socket_options=options), timeout=120)


def wait_refused(url: str, timeout_s: float = 20) -> None:
    """Until nothing listens at `url` any more (the gateway began its shutdown)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            httpx.get(url + "/health", timeout=2)
        except httpx.ConnectError:
            return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} still accepts connections {timeout_s} s after SIGTERM")


def test_sigterm_lets_requests_in_flight_finish(tmp_path: Path, model_cache_dir: Path) -> None:
    port, data = free_port(), tmp_path / "data"
    url = f"http://127.0.0.1:{port}"
    env = dict(
        os.environ,
        RLGATE_ADMIN_KEY=ADMIN_KEY,
        RLGATE_DEV_MODE="false",
        RLGATE_MODEL_CACHE_DIR=str(model_cache_dir),
        RLGATE_DATABASE_URL="",
        RLGATE_BROKER_URL="",
    )
    cmd = [sys.executable, "-m", "rlgate.cli", "up", "--port", str(port), "--data-dir", str(data)]
    with open(tmp_path / "up.log", "wb") as out:
        up = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, up, timeout_s=120)
        workers = children_of(up.pid)
        assert len(workers) == 1, "rlgate up starts one worker"
        run = httpx.post(
            url + "/admin/v1/runs",
            json={"name": "drain", "model": "tiny"},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=120,
        ).json()
        chat = url + "/v1/chat/completions"
        headers = {"Authorization": f"Bearer {run['api_key']}"}
        body = {"model": run["name"], "messages": PROMPT, **LARGE}
        with (
            slow_reader() as client,
            client.stream("POST", chat, json={**body, "stream": True}, headers=headers) as streamed,
            client.stream("POST", chat, json=body, headers=headers) as plain,
        ):
            assert (streamed.status_code, plain.status_code) == (200, 200)
            lines = streamed.iter_lines()
            first = next(lines)  # both answers have started; neither can finish
            up.send_signal(signal.SIGTERM)
            wait_refused(url)
            assert up.poll() is None, "the gateway exited with two answers still unread"
            chunks = [first, *lines]
            reply = json.loads(plain.read())

        data_lines = [c.removeprefix("data: ") for c in chunks if c.startswith("data: ")]
        assert data_lines[-1] == "[DONE]"
        events = [json.loads(d) for d in data_lines[:-1]]
        choices = [ch for e in events for ch in e["choices"]]
        assert [ch["finish_reason"] for ch in choices if ch["finish_reason"]] == ["stop"]
        content = "".join(ch["delta"].get("content") or "" for ch in choices)
        assert content == stored_content(data / "rlgate.db", events[0]["id"])
        assert reply["choices"][0]["finish_reason"] == "stop"
        tokens = reply["usage"]["completion_tokens"]
        assert len(reply["choices"][0]["logprobs"]["content"]) == tokens > 100
        assert reply["choices"][0]["message"]["content"] == stored_content(
            data / "rlgate.db", reply["id"]
        )

        up.wait(60)
        assert up.returncode in (0, 128 + signal.SIGTERM, -signal.SIGTERM), up.returncode
        deadline = time.monotonic() + 30
        while any(alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in workers), "the worker outlived `rlgate up`"
    finally:
        stop(up)
        for pid in children_of(up.pid):
            os.kill(pid, signal.SIGKILL)
