"""ShardedTransport: requests spread over pools; a connection dropped before any answer is resent.

A real asyncio TCP server on loopback plays the inference server.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from inference.http_common import ShardedTransport

OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 12\r\n\r\n{"ok": true}'


async def _serve(drop_first: int) -> tuple[asyncio.Server, list[int]]:
    """Answers every request; the first `drop_first` connections close after reading one."""
    seen: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = len(seen)
        seen.append(conn)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    ),
                    0,
                )
                await reader.readexactly(length)
                if conn < drop_first:
                    return  # closed with the request read and unanswered
                writer.write(OK)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, seen


def _url(server: asyncio.Server) -> str:
    return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def test_a_request_dropped_before_its_answer_is_resent_once() -> None:
    server, seen = await _serve(drop_first=1)
    async with server, httpx.AsyncClient(transport=ShardedTransport(4, 2)) as client:
        resp = await client.post(_url(server) + "/v1/completions", json={"prompt": [1, 2]})
        assert resp.status_code == 200 and resp.json() == {"ok": True}
    assert seen == [0, 1]  # the first connection dropped it, a second one answered


async def test_a_second_drop_is_the_callers_error() -> None:
    server, seen = await _serve(drop_first=2)
    async with server, httpx.AsyncClient(transport=ShardedTransport(4, 2)) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post(_url(server) + "/v1/completions", json={"prompt": [1]})
    assert seen == [0, 1]


async def test_a_refused_connection_is_not_resent() -> None:
    server, _ = await _serve(drop_first=0)
    url = _url(server)
    server.close()
    await server.wait_closed()
    async with httpx.AsyncClient(transport=ShardedTransport(4, 2)) as client:
        with pytest.raises(httpx.ConnectError):
            await client.post(url + "/v1/completions", json={"prompt": [1]})


async def test_requests_are_spread_over_the_pools() -> None:
    server, seen = await _serve(drop_first=0)
    async with server, httpx.AsyncClient(transport=ShardedTransport(8, 4)) as client:
        for _ in range(8):
            assert (await client.get(_url(server) + "/health")).status_code == 200
    assert len(seen) == 4  # one kept-alive connection per pool, reused in turn
