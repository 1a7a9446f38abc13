"""Request-body limits as pure ASGI middleware: a size cap and a read deadline.

Size: a declared Content-Length over `max_bytes` is answered 413 before any
of the body is read; a chunked body is cut off as soon as it passes the cap.

Time: the whole body must arrive within `read_timeout_s` of the request's
start. A body that trickles in slower is answered 408 and its connection
closed (`Connection: close`), so a caller cannot hold a connection, and the
call's slot, by sending a byte now and then. Once the body is complete the
deadline no longer applies (a streamed answer may take as long as it takes).
Either error is in the API family's shape (`gateway.errors.error_response`).
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import (
    APIError,
    InvalidRequest,
    PayloadTooLarge,
    RequestTimeout,
    error_response,
)


class BodyLimit:
    """Answers 413 before reading a body whose declared length is too large, stops reading a
    body as soon as it passes the limit, and answers 408 to one still incomplete after
    `read_timeout_s` (the handler sees the error; the client gets the answer either way)."""

    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout_s: float = 30.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                too_big = int(declared) > self.max_bytes
            except ValueError:
                await error_response(
                    InvalidRequest("invalid Content-Length header"), scope["path"]
                )(scope, receive, send)
                return
            if too_big:
                await error_response(self._too_large(), scope["path"])(scope, receive, send)
                return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout_s
        seen = 0
        complete = False
        failed: APIError | None = None

        async def limited() -> Message:
            nonlocal seen, complete, failed
            if complete:  # the body is in: what is left to receive is the disconnect
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                failed = RequestTimeout(
                    f"the request body did not arrive within {self.read_timeout_s:g} s",
                    code="body_read_timeout",
                )
                raise failed from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    failed = self._too_large()
                    raise failed
                complete = not message.get("more_body", False)
            else:
                complete = True
            return message

        async def guarded_send(message: Message) -> None:
            # Whatever the app makes of the interrupted body, the client gets the error.
            if failed is None:
                await send(message)
            elif message["type"] == "http.response.start":
                response = error_response(failed, scope["path"])
                if isinstance(failed, RequestTimeout):
                    response.headers["connection"] = "close"  # the rest of the body: never read
                await response(scope, receive, send)

        await self.app(scope, limited, guarded_send)

    def _too_large(self) -> PayloadTooLarge:
        return PayloadTooLarge(f"request body exceeds {self.max_bytes} bytes")
