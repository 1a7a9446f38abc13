"""Domain errors and the one funnel that maps them to OpenAI's error shape.

    APIError                      (message, type, param, code, status)
    ├── InvalidRequest            400 invalid_request_error
    ├── AuthenticationFailed      401 authentication_error
    ├── PermissionDenied          403 permission_error
    ├── NotFound                  404 not_found_error
    ├── Conflict                  409 conflict_error
    ├── Gone                      410 invalid_request_error (existed, removed for good)
    ├── Unprocessable             422 invalid_request_error
    ├── PayloadTooLarge           413 invalid_request_error
    ├── RateLimited               429 rate_limit_error (with Retry-After)
    ├── Unavailable               503 service_unavailable (retryable)
    │   (also: the database unreachable, SQLAlchemy's OperationalError)
    └── ...

Anything else that escapes a handler is a bug: logged with its traceback and
answered 500 with a message that leaks nothing.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

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


def error_response(err: APIError) -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after_s)} if isinstance(err, RateLimited) else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    # Drop the location kind and pydantic's union/validator tags ("function-after[...]").
    parts = [
        str(p) for p in loc if p not in ("body", "query", "path", "header") and "[" not in str(p)
    ]
    return ".".join(parts) or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = tuple(first.get("loc", ()))
        if first.get("type") == "json_invalid":
            return error_response(
                InvalidRequest("request body is not valid JSON", code="invalid_json")
            )
        param = _loc_to_param(loc)
        msg = first.get("msg", "invalid request")
        text = f"{param}: {msg}" if param else msg
        if first.get("type") == "value_error" and (param or "").split(".")[-1] == "reward":
            # A well-formed request whose reward value cannot be used (non-finite).
            return error_response(Unprocessable(text, param=param, code="invalid_reward"))
        return error_response(InvalidRequest(text, param=param, code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(str(exc.detail))
        err.status = exc.status_code
        err.type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(err)

    @app.exception_handler(DBAPIError)
    async def _database(request: Request, exc: DBAPIError) -> JSONResponse:
        # The database unreachable (restart, network cut) is retryable, not a bug.
        if isinstance(exc, OperationalError | InterfaceError) or exc.connection_invalidated:
            logger.warning("database unavailable: %s", exc.orig)
            return error_response(
                Unavailable(
                    "the database is unavailable; retry the request", code="database_unavailable"
                )
            )
        return await _bug(request, exc)

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        err = APIError("internal server error")
        err.status = 500
        err.type = "server_error"
        return error_response(err)
