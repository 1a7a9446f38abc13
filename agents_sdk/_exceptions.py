"""The exceptions agents_sdk raises, and the mapping from a gateway error response to them.

    RLGateError
    ├── APIConnectionError            the request never got an answer (retried first)
    │   └── APITimeoutError           ... because it timed out
    ├── APIResponseError              a 2xx answer that is not the JSON we expect
    └── APIStatusError                a 4xx/5xx answer (status, message, type, param, code, body)
        ├── BadRequestError           400, 422
        ├── AuthenticationError       401
        ├── PermissionDeniedError     403
        ├── NotFoundError             404
        ├── ConflictError             409
        ├── RateLimitError            429 (retried first)
        └── ServerError               5xx (retried first)

Invalid arguments (a non-finite reward, an id with a slash) raise ValueError before
anything is sent.
"""

from __future__ import annotations

from typing import Any

import httpx

__all__ = [
    "APIConnectionError",
    "APIResponseError",
    "APIStatusError",
    "APITimeoutError",
    "AuthenticationError",
    "BadRequestError",
    "ConflictError",
    "NotFoundError",
    "PermissionDeniedError",
    "RLGateError",
    "RateLimitError",
    "ServerError",
]


class RLGateError(Exception):
    """Base of everything agents_sdk raises for a failed call."""


class APIConnectionError(RLGateError):
    """No response: connection refused or reset, DNS failure, timeout."""


class APITimeoutError(APIConnectionError):
    """The request timed out."""


class APIResponseError(RLGateError):
    """The gateway answered 2xx with a body that is not what the SDK expects."""

    def __init__(self, message: str, *, response: httpx.Response) -> None:
        super().__init__(message)
        self.response = response


class APIStatusError(RLGateError):
    """The gateway answered with an error status; fields come from its `{"error": {...}}` body."""

    def __init__(
        self,
        message: str,
        *,
        response: httpx.Response,
        body: Any,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.response = response
        self.status = response.status_code
        self.body = body
        self.type = type
        self.param = param
        self.code = code

    def __str__(self) -> str:
        return f"{self.status} {self.message}"


class BadRequestError(APIStatusError):
    """400 or 422: the request was malformed or a field was invalid."""


class AuthenticationError(APIStatusError):
    """401: missing, wrong or revoked API key."""


class PermissionDeniedError(APIStatusError):
    """403: the key is valid but may not do this."""


class NotFoundError(APIStatusError):
    """404: unknown completion, episode or model."""


class ConflictError(APIStatusError):
    """409: the request conflicts with the current state."""


class RateLimitError(APIStatusError):
    """429: too many requests."""


class ServerError(APIStatusError):
    """5xx: the gateway failed or is unavailable."""


_BY_STATUS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    422: BadRequestError,
    429: RateLimitError,
}


def connection_error(exc: httpx.TransportError) -> APIConnectionError:
    """The exception for a request that got no answer: a timeout or another transport error."""
    cls = APITimeoutError if isinstance(exc, httpx.TimeoutException) else APIConnectionError
    return cls(f"could not reach the gateway: {exc!r}")


def status_error(response: httpx.Response) -> APIStatusError:
    """The exception for an error response, filled from its OpenAI-style error body."""
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        error = {}
    message = error.get("message") or response.text or response.reason_phrase
    status = response.status_code
    cls = ServerError if status >= 500 else _BY_STATUS.get(status, APIStatusError)
    return cls(
        str(message),
        response=response,
        body=body,
        type=error.get("type"),
        param=error.get("param"),
        code=error.get("code"),
    )
