"""The trainer's weight server: a shared secret on every request, one configured interface.

A real `WeightServer` (its HTTP server in a thread) and real peers over loopback
TCP: a raw socket for what a stranger sends, `inference.weight_source.open_transfer`
(what the gateway's backends call) for the legitimate peer, which then receives
the weights over the gloo rendezvous the answer names.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator

import httpx
import pytest
import torch

from inference.backend import BackendError
from inference.weight_source import CollectiveSource, open_transfer
from inference.weight_wire import rlgate_weight_wire as wire
from trainer.weight_server import WeightServer

SECRET = "weight-sync-secret-for-the-test"
STATE = {"model.norm.weight": torch.arange(6, dtype=torch.float32)}


@pytest.fixture
def server() -> Iterator[WeightServer]:
    ws = WeightServer("127.0.0.1", timeout_s=30, secret=SECRET)
    ws.publish("r1", 3, STATE)
    yield ws
    ws.close()


def _raw_post(server: WeightServer, authorization: str | None) -> bytes:
    """A transfer request over a bare socket; the whole answer, read until the server closes."""
    host, port = server._httpd.server_address[:2]
    body = json.dumps({"version": 3, "receivers": 1}).encode()
    head = [
        "POST /runs/r1/transfers HTTP/1.1",
        f"Host: {host}:{port}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
    ]
    if authorization is not None:
        head.append(f"Authorization: {authorization}")
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        answer = b""
        while chunk := sock.recv(65536):  # returns b"" once the server closed the connection
            answer += chunk
    return answer


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {SECRET}", "Bearer "])
def test_a_peer_without_the_secret_is_refused_and_closed(server, authorization) -> None:
    answer = _raw_post(server, authorization)  # returns only because the server closed it
    status_line, _, rest = answer.partition(b"\r\n")
    assert b" 401 " in status_line, answer[:300]
    assert b"connection: close" in rest.lower()
    assert b"rendezvous" not in answer and b"port" not in answer.split(b"\r\n\r\n", 1)[1]
    assert list(server.transfers) == []


def test_get_routes_need_the_secret_too(server) -> None:
    assert httpx.get(server.url + "/health", timeout=10).status_code == 401
    auth = {"Authorization": f"Bearer {SECRET}"}
    assert httpx.get(server.url + "/health", headers=auth, timeout=10).status_code == 200


def test_the_gateway_side_without_the_secret_gets_a_backend_error(server) -> None:
    source = CollectiveSource(server.url_for("r1"), 3, checkpoint_dir=None)  # type: ignore[arg-type]
    with pytest.raises(BackendError, match="401"):
        asyncio.run(open_transfer(source, 1, secret="wrong"))
    with pytest.raises(BackendError, match="401"):
        asyncio.run(open_transfer(source, 1))


def test_the_right_secret_is_served_the_weights(server) -> None:
    source = CollectiveSource(server.url_for("r1"), 3, checkpoint_dir=None)  # type: ignore[arg-type]
    rdv, _ = asyncio.run(open_transfer(source, 1, secret=SECRET))
    assert rdv.version == 3 and rdv.host == "127.0.0.1"
    got = {k: v.clone() for k, v in wire.receive_weights(rdv, 1, 30)}
    assert got.keys() == STATE.keys() and torch.equal(
        got["model.norm.weight"], STATE["model.norm.weight"]
    )


def test_it_listens_on_the_configured_interface_only() -> None:
    ws = WeightServer("127.0.0.2", timeout_s=30, secret=SECRET)  # a loopback alias
    try:
        host, port = ws._httpd.server_address[:2]
        assert host == "127.0.0.2" and ws.url == f"http://127.0.0.2:{port}"
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        ws.close()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", ""])
def test_a_wildcard_bind_is_refused(host: str) -> None:
    with pytest.raises(ValueError, match="wildcard"):
        WeightServer(host, secret=SECRET)


def test_off_loopback_the_secret_is_required() -> None:
    with pytest.raises(ValueError, match="RLGATE_WEIGHT_SYNC_SECRET"):
        WeightServer("10.1.2.3")  # refused before anything binds


def test_the_embedded_stack_generates_one_secret_for_its_processes(tmp_path) -> None:
    """`rlgate up` and the demo's stack: a fresh secret per start unless one is set, in the
    environment every process they start builds its Settings from."""
    from core.settings import Settings
    from rlgate.stack import settings_env, with_secrets

    base = Settings(data_dir=tmp_path, weight_sync_secret="")
    first, second = with_secrets(base), with_secrets(base)
    assert len(first.weight_sync_secret) >= 32
    assert first.weight_sync_secret != second.weight_sync_secret
    assert settings_env(first)["RLGATE_WEIGHT_SYNC_SECRET"] == first.weight_sync_secret
    chosen = base.model_copy(update={"weight_sync_secret": SECRET})
    assert with_secrets(chosen).weight_sync_secret == SECRET
