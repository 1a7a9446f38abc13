"""The HTTP backends' sampling calls over aiohttp: answers, error mapping, resend, cancel.

A real asyncio TCP server on loopback plays an inference server: every GET is
answered (httpx, the control client), and each POST by the next action of a
script (aiohttp, the sampling client). The backend is the smallest
`HttpBackend` (`Plain`), so these tests pin the shared sampling path, not one
server's wire format; `Unlabelled` is the same server without per-token
version labels, whose non-streaming calls go out as streams.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from inference.backend import BackendError, BackendOverloaded
from inference.http_backend import Completion, HttpBackend, StreamEvent, Tokens
from inference.http_common import HttpBackendConfig
from inference.types import FinishReason, GenerateRequest, SamplingParams, SwapPolicy

# One completion's action: answers (or not) on `writer`; False closes the connection.
Action = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]

MODELS = {"data": [{"id": "m", "max_model_len": 512}]}
REQ = GenerateRequest([1, 2, 3], SamplingParams(max_tokens=4))


class Plain(HttpBackend):
    """POST /generate `{"prompt", "stream"}`; answers `{"choices": [_choice(...)]}`, one per
    event when streaming. It says it labels tokens, so `generate` is one JSON call."""

    name = "Plain"
    labels_tokens = True

    @staticmethod
    def _read(answer: Any) -> tuple[Tokens, FinishReason | None]:
        choice = answer["choices"][0]
        lps = choice["logprobs"]["token_logprobs"]
        return list(zip(choice["token_ids"], lps, strict=True)), choice["finish_reason"]

    async def _complete(self, request: GenerateRequest) -> Completion:
        body = {"prompt": request.prompt_token_ids, "stream": False}
        tokens, finish = self._read(await self._post("/generate", body))
        assert finish is not None
        return Completion(tokens, finish)

    async def _stream_tokens(self, request: GenerateRequest) -> AsyncIterator[StreamEvent]:
        body = {"prompt": request.prompt_token_ids, "stream": True}
        async for event in self._events("/generate", body):
            yield StreamEvent(*self._read(event))

    async def _pause(self, policy: SwapPolicy) -> None:
        raise AssertionError("no swap here")

    async def _reload(self, checkpoint_dir: Path, version: int) -> None:
        raise AssertionError("no swap here")

    async def _resume(self) -> None:
        raise AssertionError("no swap here")


class Unlabelled(Plain):
    labels_tokens = False


def _choice(tokens: list[int], finish: str | None) -> dict:
    return {
        "token_ids": tokens,
        "logprobs": {"token_logprobs": [-0.5] * len(tokens)},
        "finish_reason": finish,
    }


def answer(status: int, body: bytes | dict) -> Action:
    """A complete answer with a Content-Length."""
    raw = json.dumps(body).encode() if isinstance(body, dict) else body

    async def act(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(
            f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n".encode()
            + raw
        )
        await writer.drain()
        return True

    return act


def sse(events: list[dict], done: bool = True, hold: asyncio.Event | None = None) -> Action:
    """A chunked event stream; with `hold`, it stops after the events and waits for the
    client to close the connection (then sets `hold`)."""

    async def act(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        lines = [f"data: {json.dumps(e)}\n\n" for e in events]
        for line in lines + (["data: [DONE]\n\n"] if done and hold is None else []):
            writer.write(f"{len(line.encode()):x}\r\n{line}\r\n".encode())
            await writer.drain()
        if hold is not None:
            await reader.read()  # until the client closes
            hold.set()
            return False
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    return act


async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Close with the request read and unanswered (a kept-alive connection timing out)."""
    return False


class Server:
    """Loopback HTTP/1.1 server: GET /v1/models answered, each POST by the next action."""

    def __init__(self, *actions: Action) -> None:
        self.actions = list(actions)
        self.connections = 0
        self.bodies: list[dict] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method = head.split(b" ")[0]
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    ),
                    0,
                )
                body = await reader.readexactly(length)
                if method == b"GET":
                    await answer(200, MODELS)(reader, writer)
                    continue
                self.bodies.append(json.loads(body))
                if not await self.actions.pop(0)(reader, writer):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()


def _backend(url: str, **cfg: float) -> Plain:
    return Plain(HttpBackendConfig(base_url=url, **cfg))  # type: ignore[arg-type]


async def test_a_json_answer_and_the_connection_kept_alive() -> None:
    ok = {"choices": [_choice([5, 6], "stop")]}
    async with Server(answer(200, ok), answer(200, ok)) as server:
        backend = _backend(server.url)
        try:
            for _ in range(2):
                result = await backend.generate(REQ)
                assert result.output_token_ids == [5, 6] and result.finish_reason == "stop"
        finally:
            await backend.close()
    assert server.bodies[0]["prompt"] == [1, 2, 3] and server.bodies[0]["stream"] is False
    assert server.connections == 1  # aiohttp's, for both completions


async def test_a_server_without_labels_gets_every_call_as_a_stream() -> None:
    events = [{"choices": [_choice([t], None)]} for t in (7, 8)]
    events.append({"choices": [_choice([9], "stop")]})
    async with Server(sse(events)) as server:
        backend = Unlabelled(HttpBackendConfig(base_url=server.url))
        try:
            result = await backend.generate(REQ)
        finally:
            await backend.close()
    assert server.bodies[0]["stream"] is True  # so that a keep-mode swap can mark it
    assert result.output_token_ids == [7, 8, 9] and result.finish_reason == "stop"
    assert result.policy_version == 0 and result.version_starts == ()


async def test_a_stream_and_its_connection_back_to_the_pool() -> None:
    events = [{"choices": [_choice([t], None)]} for t in (7, 8)]
    events.append({"choices": [_choice([9], "length")]})
    async with Server(sse(events), sse(events)) as server:
        backend = _backend(server.url)
        try:
            for _ in range(2):
                stream = backend.start_stream(REQ)
                assert [t async for t, _ in stream.tokens()] == [7, 8, 9]
                assert (await stream.result()).finish_reason == "length"
        finally:
            await backend.close()
    assert server.bodies[0]["stream"] is True
    assert server.connections == 1  # the second stream reused the first one's connection


async def test_an_error_event_fails_the_stream() -> None:
    events: list[dict] = [{"choices": [_choice([7], None)]}, {"error": {"message": "engine died"}}]
    async with Server(sse(events)) as server:
        backend = _backend(server.url)
        try:
            stream = backend.start_stream(REQ)
            with pytest.raises(BackendError, match="engine died"):
                await stream.result()
        finally:
            await backend.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_429_is_overloaded(stream: bool) -> None:
    async with Server(answer(429, b"slow down")) as server:
        backend = _backend(server.url)
        try:
            with pytest.raises(BackendOverloaded, match="HTTP 429: slow down"):
                if stream:
                    await backend.start_stream(REQ).result()
                else:
                    await backend.generate(REQ)
        finally:
            await backend.close()


async def test_500_and_a_body_that_is_not_json_are_backend_errors() -> None:
    async with Server(answer(500, b"boom"), answer(200, b"<html>")) as server:
        backend = _backend(server.url)
        try:
            with pytest.raises(BackendError, match="HTTP 500: boom") as exc:
                await backend.generate(REQ)
            assert not isinstance(exc.value, BackendOverloaded)
            with pytest.raises(BackendError, match="not JSON: <html>"):
                await backend.generate(REQ)
        finally:
            await backend.close()


async def test_a_request_dropped_before_its_answer_is_resent_once() -> None:
    ok = {"choices": [_choice([5], "stop")]}
    async with Server(drop, answer(200, ok)) as server:
        backend = _backend(server.url)
        try:
            assert (await backend.generate(REQ)).output_token_ids == [5]
        finally:
            await backend.close()
    assert len(server.bodies) == 2  # sent, dropped, sent again on a new connection


async def test_a_second_drop_is_a_backend_error() -> None:
    async with Server(drop, drop) as server:
        backend = _backend(server.url)
        try:
            with pytest.raises(BackendError, match=re.escape("Plain at http://127.0.0.1")):
                await backend.generate(REQ)
        finally:
            await backend.close()
    assert len(server.bodies) == 2


async def test_a_refused_connection_is_a_backend_error_naming_the_server() -> None:
    async with Server() as server:
        backend = _backend(server.url)
        try:
            assert await backend.health()  # over httpx, before the server stops listening
            url = server.url
            assert server.server is not None
            server.server.close()
            refused = re.escape(f"Plain at {url}: ClientConnectorError")
            with pytest.raises(BackendError, match=refused):
                await backend.generate(REQ)
        finally:
            await backend.close()
    assert server.bodies == []


async def test_a_silent_server_times_out() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        await reader.read()
        return False

    async with Server(silent) as server:
        backend = _backend(server.url, read_timeout_s=0.2)
        try:
            with pytest.raises(BackendError, match="Timeout"):
                await backend.generate(REQ)
        finally:
            await backend.close()


async def test_cancelling_a_stream_closes_its_connection() -> None:
    closed = asyncio.Event()
    async with Server(sse([{"choices": [_choice([7], None)]}], hold=closed)) as server:
        backend = _backend(server.url)
        try:
            stream = backend.start_stream(REQ)
            tokens = stream.tokens()
            assert await anext(tokens) == (7, -0.5)
            stream.cancel()
            await asyncio.wait_for(closed.wait(), 5)  # the server saw the connection close
            result = await stream.result()
            assert result.finish_reason == "cancelled" and result.output_token_ids == [7]
        finally:
            await backend.close()
