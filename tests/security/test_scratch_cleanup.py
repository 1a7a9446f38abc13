"""Scratch files of a Parquet export and of a merged-LoRA download are removed however the
client hangs up: before the answer starts, or in the middle of it.

A real gateway whose TMPDIR is a folder of the test's own; a LoRA run trained to v1 by
the real trainer (tests/security/_checkpoints.py); a raw socket as the client, which
resets the connection after sending the request or after the first bytes.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from rlgate.stack import stop
from tests.security._checkpoints import commit_step, queue_step

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCRATCH_PREFIXES = ("rlgate-export-", "merged-")


@dataclass
class Stack:
    server: object
    run_id: str
    tmp: Path

    def scratch(self) -> list[str]:
        return sorted(p.name for p in self.tmp.iterdir() if p.name.startswith(SCRATCH_PREFIXES))


@pytest.fixture(scope="module")
def stack(gateway_launcher, tmp_path_factory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("scratch")
    tmp = root / "tmp"
    tmp.mkdir()
    server = gateway_launcher(root / "data", extra_env={"TMPDIR": str(tmp)})
    try:
        run = queue_step(server, "scratch", lora_rank=4, lora_alpha=8)
        won = commit_step(server, run["run_id"], root / "attempt")
        assert won["version"] == 1, won
        yield Stack(server, run["run_id"], tmp)
    finally:
        stop(server.proc)


def _hang_up(stack: Stack, path: str, read_bytes: int) -> int:
    """GET `path` as the admin, read `read_bytes` of the answer (0: none), then reset the
    connection; returns how many bytes were read."""
    url = urlsplit(stack.server.url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the server blocks soon
    sock.connect((url.hostname, url.port))
    key = stack.server.admin_key
    sock.sendall(
        f"GET {path} HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {key}\r\n\r\n".encode()
    )
    got = 0
    sock.settimeout(120)
    while got < read_bytes:
        data = sock.recv(4096)
        if not data:
            break
        got += len(data)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
    sock.close()
    return got


def _settled_scratch(stack: Stack, timeout_s: float = 60.0) -> list[str]:
    """The scratch entries once none is left, or whatever is left after `timeout_s` (a merge
    or an export still being built counts as not settled yet)."""
    deadline = time.monotonic() + timeout_s
    time.sleep(1.0)  # the server notices the reset on its next send
    while (left := stack.scratch()) and time.monotonic() < deadline:
        time.sleep(0.25)
    return left


@pytest.mark.parametrize(
    ("what", "path"),
    [
        ("export", "/admin/v1/runs/{run}/export?format=parquet"),
        ("merged", "/admin/v1/runs/{run}/versions/1/checkpoint?merged=true"),
    ],
)
@pytest.mark.parametrize("read_bytes", [0, 200], ids=["before-the-answer", "mid-stream"])
def test_scratch_is_removed_when_the_client_hangs_up(
    stack: Stack, what: str, path: str, read_bytes: int
) -> None:
    assert stack.scratch() == []
    got = _hang_up(stack, path.format(run=stack.run_id), read_bytes)
    assert got >= read_bytes
    assert _settled_scratch(stack) == [], f"{what}: scratch left after the client hung up"
    # the gateway still answers the same request whole afterwards
    import httpx

    with httpx.Client(base_url=stack.server.url, timeout=120) as client:
        resp = client.get(path.format(run=stack.run_id), headers=stack.server.admin_headers())
    assert resp.status_code == 200 and len(resp.content) > 0
    assert _settled_scratch(stack) == []
