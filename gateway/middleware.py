"""Request-body size limit as pure ASGI middleware: Content-Length and chunked bodies alike."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import InvalidRequest, PayloadTooLarge, error_response


class BodyLimit:
    """Answers 413 before reading a body whose declared length is too large, and stops
    reading a chunked body as soon as it passes the limit (the handler sees the error)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

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
                await error_response(self._error(), scope["path"])(scope, receive, send)
                return
        seen = 0
        exceeded = False

        async def limited() -> Message:
            nonlocal seen, exceeded
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    exceeded = True
                    raise self._error()
            return message

        async def guarded_send(message: Message) -> None:
            # Whatever the app makes of the interrupted body, the client gets the 413.
            if not exceeded:
                await send(message)
            elif message["type"] == "http.response.start":
                await error_response(self._error(), scope["path"])(scope, receive, send)

        await self.app(scope, limited, guarded_send)

    def _error(self) -> PayloadTooLarge:
        return PayloadTooLarge(f"request body exceeds {self.max_bytes} bytes")
