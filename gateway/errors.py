"""Domain errors and the one funnel that maps them to OpenAI's error shape.

    APIError                      (message, type, param, code, status)
    ├── InvalidRequest            400 invalid_request_error
    ├── AuthenticationFailed      401 authentication_error
    ├── PermissionDenied          403 permission_error
    ├── NotFound                  404 not_found_error
    ├── Conflict                  409 conflict_error
    ├── Gone                      410 invalid_request_error (existed, removed for good)
    ├── Unprocessable             422 invalid_request_error
    ├── RequestTimeout            408 invalid_request_error (body too slow)
    ├── PayloadTooLarge           413 invalid_request_error
    ├── RateLimited               429 rate_limit_error (with Retry-After)
    ├── Unavailable               503 service_unavailable (retryable)
    │   (also: the database unreachable, SQLAlchemy's OperationalError)
    └── ...

Anything else that escapes a handler is a bug: logged with its traceback and
answered 500 with a message that leaks nothing.

One contract for every endpoint, streaming or not:

* a backend failure is mapped here once (`backend_failure`): overloaded -> 429
  with `Retry-After`, anything else -> 503 `backend_unavailable`;
* the database unreachable -> 503 `database_unavailable`;
* the body is OpenAI's `{"error": {...}}`, except under Anthropic's paths
  (`/v1/messages...`), which get Anthropic's `{"type": "error", "error":
  {"type", "message"}}` with the same status and headers.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from inference.backend import BackendError, BackendOverloaded, VersionMoved

logger = logging.getLogger(__name__)


class APIError(Exception):
    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        """The same error as Anthropic's API words it."""
        kind = ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else None)
        return {
            "type": "error",
            "error": {"type": kind or "invalid_request_error", "message": self.message},
        }


class InvalidRequest(APIError):
    status = 400


class AuthenticationFailed(APIError):
    status = 401
    type = "authentication_error"


class PermissionDenied(APIError):
    status = 403
    type = "permission_error"


class NotFound(APIError):
    status = 404
    type = "not_found_error"


class Conflict(APIError):
    status = 409
    type = "conflict_error"


class Gone(APIError):
    """The resource existed and was removed for good (a pruned checkpoint): retrying won't help."""

    status = 410


class RequestTimeout(APIError):
    """The request body did not arrive within the read deadline."""

    status = 408


class PayloadTooLarge(APIError):
    status = 413


class Unprocessable(APIError):
    status = 422


class RateLimited(APIError):
    """Paused run or a full backend queue: retry after `retry_after_s`."""

    status = 429
    type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after_s: int = 1, **kw) -> None:
        super().__init__(message, **kw)
        self.retry_after_s = retry_after_s


class Unavailable(APIError):
    status = 503
    type = "service_unavailable"


# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


def backend_failure(exc: BackendError) -> APIError:
    """The one mapping of a backend failure to HTTP, for every endpoint and stream."""
    if isinstance(exc, BackendOverloaded):
        return RateLimited(
            f"the run's backend is at capacity; retry shortly ({exc})", code="backend_overloaded"
        )
    if isinstance(exc, VersionMoved):
        return Conflict(
            f"the pinned version was swapped out as this call started ({exc}); retry it",
            code="version_moved",
        )
    return Unavailable(
        "the inference backend failed; retry the request", code="backend_unavailable"
    )


def database_failure(exc: DBAPIError | PoolTimeout) -> APIError | None:
    """The one mapping of a database error to HTTP: unreachable (restart, network cut) or
    busy (no pooled connection came free within the pool's timeout: the load is past what
    the pool serves) is a retryable 503; None for anything else, which is a bug."""
    if isinstance(exc, PoolTimeout):
        logger.warning("database busy: %s", exc)
        return Unavailable("the database is busy; retry the request", code="database_busy")
    if isinstance(exc, OperationalError | InterfaceError) or exc.connection_invalidated:
        logger.warning("database unavailable: %s", exc.orig)
        return Unavailable(
            "the database is unavailable; retry the request", code="database_unavailable"
        )
    return None


def is_anthropic_path(path: str) -> bool:
    """Anthropic's endpoints answer errors in Anthropic's shape (also under episode prefixes)."""
    return "/v1/messages" in path


def error_response(err: APIError, path: str = "") -> JSONResponse:
    """`err` as a response; `path` (the request's) picks OpenAI's or Anthropic's shape."""
    headers = {"Retry-After": str(err.retry_after_s)} if isinstance(err, RateLimited) else None
    body = err.anthropic_body() if is_anthropic_path(path) else err.body()
    return JSONResponse(body, status_code=err.status, headers=headers)


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    # Drop the location kind and pydantic's union/validator tags ("function-after[...]").
    parts = [
        str(p) for p in loc if p not in ("body", "query", "path", "header") and "[" not in str(p)
    ]
    return ".".join(parts) or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        path = request.url.path
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = tuple(first.get("loc", ()))
        if first.get("type") == "json_invalid":
            return error_response(
                InvalidRequest("request body is not valid JSON", code="invalid_json"), path
            )
        param = _loc_to_param(loc)
        msg = first.get("msg", "invalid request")
        text = f"{param}: {msg}" if param else msg
        if first.get("type") == "value_error" and (param or "").split(".")[-1] == "reward":
            # A well-formed request whose reward value cannot be used (non-finite).
            return error_response(Unprocessable(text, param=param, code="invalid_reward"), path)
        return error_response(InvalidRequest(text, param=param, code="invalid_value"), path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(str(exc.detail))
        err.status = exc.status_code
        err.type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(err, request.url.path)

    @app.exception_handler(DBAPIError)
    @app.exception_handler(PoolTimeout)
    async def _database(request: Request, exc: DBAPIError | PoolTimeout) -> JSONResponse:
        err = database_failure(exc)
        if err is None:
            return await _bug(request, exc)
        return error_response(err, request.url.path)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        err = APIError("internal server error")
        err.status = 500
        err.type = "server_error"
        return error_response(err, request.url.path)
