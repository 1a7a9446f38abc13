"""Declares in the OpenAPI schema the error answers and stream media types the gateway gives.

FastAPI documents a route's success model and a 422 `HTTPValidationError` that this gateway
never sends: `gateway.errors` answers every failure in the API family's shape (OpenAI's
`{"error": {...}}`, Anthropic's `{"type": "error", "error": {...}}` under `/v1/messages`).
The schema is a contract that clients and the schema fuzzer (`tests/api/test_schema_fuzz.py`)
check answers against, so the statuses each kind of operation can answer are declared here,
in one place, next to the shape that funnel writes; a route that starts answering a status not
listed here fails that suite rather than drifting from its documentation.
"""

from __future__ import annotations

from typing import Any, cast

from fastapi import FastAPI

from gateway.errors import is_anthropic_path

OPENAI_ERROR = "ErrorResponse"
ANTHROPIC_ERROR = "AnthropicErrorResponse"

ERROR_SCHEMAS: dict[str, dict[str, Any]] = {
    OPENAI_ERROR: {
        "title": OPENAI_ERROR,
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            }
        },
    },
    ANTHROPIC_ERROR: {
        "title": ANTHROPIC_ERROR,
        "type": "object",
        "required": ["type", "error"],
        "properties": {
            "type": {"const": "error"},
            "error": {
                "type": "object",
                "required": ["type", "message"],
                "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
            },
        },
    },
}

# One server-sent event (OpenAPI 3.2's reading of a `text/event-stream` schema): its `data` is
# a JSON chunk of the API family, or OpenAI's closing `[DONE]`.
SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "event": {"type": "string"},
        "data": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}

DESCRIPTIONS = {
    400: "Invalid request: malformed body, wrong type, or a value past a documented cap",
    401: "No key, an unknown or revoked key, or a key of the wrong kind for this endpoint",
    403: "The key is valid but may not do this",
    404: "No such resource for this key (another run's resources are not found)",
    408: "The request body did not arrive within the read deadline",
    409: "The request conflicts with the resource's current state",
    410: "The resource existed and was removed for good (a pruned checkpoint)",
    413: "The request body is larger than the gateway's max_body_bytes",
    422: "A well-formed value that cannot be used (a non-finite reward)",
    429: "Rate limit, quota, paused run or full backend: retry after Retry-After",
    503: "The database or the inference backend is unavailable: retryable",
}

# Every route reads a key (401) and the store (503); parameters are validated (400).
BASE = (400, 401, 404, 503)
# A body is capped and read under a deadline.
WITH_BODY = (408, 413)
# Agent calls are metered, shed under overload and refused while their run is paused.
AGENT = (422, 429)
# Admin writes meet state (a run already stopped, a pruned version) and the key's scope.
ADMIN = (403, 409, 410, 422)


def statuses(path: str, has_body: bool) -> tuple[int, ...]:
    """The error statuses one operation can answer."""
    if path == "/health":
        return (503,)
    extra = ADMIN if path.startswith("/admin/") else AGENT
    return tuple(sorted({*BASE, *extra, *(WITH_BODY if has_body else ())}))


def _error_response(status: int, path: str) -> dict[str, Any]:
    name = ANTHROPIC_ERROR if is_anthropic_path(path) else OPENAI_ERROR
    return {
        "description": DESCRIPTIONS[status],
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
    }


def _streams(schema: dict[str, Any], operation: dict[str, Any]) -> bool:
    """Whether the operation's request model has OpenAI's/Anthropic's `stream` switch."""
    body = operation.get("requestBody", {}).get("content", {}).get("application/json", {})
    ref = body.get("schema", {}).get("$ref", "")
    model = schema.get("components", {}).get("schemas", {}).get(ref.rsplit("/", 1)[-1], {})
    return "stream" in model.get("properties", {})


def declare_errors(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with each operation's error answers and stream media type declared (in place)."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(ERROR_SCHEMAS)
    for path, item in schema.get("paths", {}).items():
        for operation in item.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)  # FastAPI's HTTPValidationError: never sent here
            for status in statuses(path, "requestBody" in operation):
                responses[str(status)] = _error_response(status, path)
            ok = next((responses[s] for s in ("200", "201") if s in responses), None)
            if ok is not None and _streams(schema, operation):
                # `stream: true` answers server-sent events instead of the JSON object.
                ok.setdefault("content", {})["text/event-stream"] = {"schema": SSE_EVENT}
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    return schema


def install_error_responses(app: FastAPI) -> None:
    """Make `app.openapi()` (and so `/openapi.json`) declare the error answers."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = declare_errors(build())
        return app.openapi_schema

    # FastAPI's documented hook for a custom schema is replacing `openapi` on the instance;
    # typed as a method, it is assigned through `Any`.
    cast(Any, app).openapi = openapi
