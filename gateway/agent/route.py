"""Agent routes' per-call handler: FastAPI's declarations, a shorter path through each call.

An agent's sampling call is the gateway's hot path. FastAPI's generic handler
pays, per call, for what these routes never use: the content type parsed with
`email.message`, the body decoded with `json` and then validated from Python
objects, a dependency solver walking a tree of one level, and the returned
model validated a second time against `response_model` before it is dumped.
Under wrk (plain mode, 128 clients, the bench's stub), serving the sampling
routes through this handler instead took about a fifth off the gateway's CPU
per call.

`AgentRoute` keeps everything FastAPI builds from the endpoint's signature
(routing, OpenAPI schema, the dependant) and swaps only the function that
serves a request. That function handles the shapes an agent route has:

* one body parameter whose type is a pydantic model, validated straight from
  the JSON bytes (`model_validate_json`);
* `Request` and `Response` parameters;
* dependencies that take only the `Request` (`async def dep(request)`);
* `str` path parameters.

A route with anything else (query or header parameters, nested or `yield`
dependencies, a custom response class or response-model filters) is refused
when the app is built, not served slower. Dependencies given to the router
(`APIRouter(dependencies=...)`) run like the route's own; ones given to
`include_router` are not seen (FastAPI keeps them outside the route), so the
app includes these routers without any.

What a client sees is FastAPI's behaviour, kept on purpose (tests/unit/
test_agent_route.py compares the two): a body that is not JSON is refused
before any dependency runs; otherwise dependencies run first (a bad key is a
401 whatever the body), then the body is validated; a body without a JSON
content type, an empty body and a body that fails validation raise the same
`RequestValidationError`, with `loc` starting at "body", that the error funnel
(`gateway.errors`) turns into a 400; a body that cannot be read (the client
gone) is FastAPI's 400, not a 500; JSON that Python's parser cannot read
(nested past its recursion limit, bytes that are not UTF-8/16/32, an integer
past its digit limit) is FastAPI's 400 "There was an error parsing the body",
before any dependency runs, and JSON only Python's parser reads (a BOM, UTF-16)
is accepted as FastAPI accepts it; headers set on the `Response` parameter
are added to a JSON answer and not to a `Response` the endpoint returns.
One departure: a string with a lone surrogate (`"\\ud800"`), which FastAPI let
through to a 500 wherever the text was encoded, is refused as invalid JSON.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request, Response
from fastapi.datastructures import DefaultPlaceholder
from fastapi.dependencies.utils import get_missing_field_error
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import HTTPException, RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute, serialize_response
from pydantic import BaseModel, ValidationError

from gateway.errors import APIError

if TYPE_CHECKING:
    from fastapi._compat import ModelField

Handler = Callable[[Request], Coroutine[Any, Any, Response]]


class AgentRoute(APIRoute):
    """An `APIRoute` served by `agent_handler` (use as an `APIRouter`'s `route_class`)."""

    def get_route_handler(self) -> Handler:
        return agent_handler(self)


@dataclass(frozen=True)
class _Plan:
    """Where each of the endpoint's arguments comes from, worked out once per route."""

    body_field: ModelField | None
    body_model: type[BaseModel] | None
    request_name: str | None
    response_name: str | None
    # (parameter, dependency); no parameter: a router's `dependencies=`, run for its checks
    dependencies: tuple[tuple[str | None, Callable[[Request], Awaitable[Any]]], ...]
    path_names: tuple[str, ...]


def _refuse(route: APIRoute, what: str) -> TypeError:
    return TypeError(f"AgentRoute {route.path}: {what}; declare it on a plain APIRouter instead")


def _plan(route: APIRoute) -> _Plan:
    d = route.dependant
    for kind in ("query_params", "header_params", "cookie_params"):
        if getattr(d, kind):
            raise _refuse(route, f"{kind.replace('_', ' ')} are not handled")
    if d.background_tasks_param_name or d.security_scopes_param_name:
        raise _refuse(route, "background tasks and security scopes are not handled")
    if d.http_connection_param_name or d.websocket_param_name:
        raise _refuse(route, "connection parameters are not handled")
    if not isinstance(route.response_class, DefaultPlaceholder):
        raise _refuse(route, "a custom response class is not handled")
    filters = (
        route.response_model_include,
        route.response_model_exclude,
        route.response_model_exclude_unset,
        route.response_model_exclude_defaults,
        route.response_model_exclude_none,
    )
    if any(filters) or not route.response_model_by_alias:
        raise _refuse(route, "response-model filters are not handled")
    body_field = body_model = None
    if d.body_params:
        (body_field,) = d.body_params
        model = body_field.field_info.annotation
        if not (inspect.isclass(model) and issubclass(model, BaseModel)):
            raise _refuse(route, f"body {body_field.name!r} is not one pydantic model")
        if (
            getattr(body_field.field_info, "embed", False)
            or not body_field.field_info.is_required()
        ):
            raise _refuse(route, f"body {body_field.name!r} is embedded or optional")
        body_model = model
    deps = []
    for sub in d.dependencies:
        takes = (sub.dependencies, sub.path_params, sub.query_params, sub.header_params)
        if any(takes) or sub.body_params or sub.cookie_params or sub.response_param_name:
            raise _refuse(route, f"dependency {sub.name!r} takes more than the request")
        if not inspect.iscoroutinefunction(sub.call) or sub.request_param_name is None:
            raise _refuse(route, f"dependency {sub.name!r} is not `async def dep(request)`")
        deps.append((sub.name, sub.call))
    for field in d.path_params:
        if field.field_info.annotation is not str:
            raise _refuse(route, f"path parameter {field.name!r} is not a str")
    return _Plan(
        body_field,
        body_model,
        d.request_param_name,
        d.response_param_name,
        tuple(deps),
        tuple(f.name for f in d.path_params),
    )


def _is_json(content_type: str | None) -> bool:
    """FastAPI's test: `application/json` or `application/<anything>+json`, any parameters."""
    if not content_type:
        return False
    kind, _, subtype = content_type.partition(";")[0].strip().lower().partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


def _json_invalid(pos: int, why: str, doc: str | bytes) -> RequestValidationError:
    return RequestValidationError(
        [
            {
                "type": "json_invalid",
                "loc": ("body", pos),
                "msg": "JSON decode error",
                "input": {},
                "ctx": {"error": why},
            }
        ],
        body=doc,
    )


def _decode(raw: bytes) -> Any:
    """The body as Python's `json` reads it, refused as FastAPI refuses it (both before any
    dependency runs): not JSON is a `json_invalid` 400; JSON that cannot be read (nested past
    the recursion limit, not UTF-8/16/32, an integer past Python's digit limit) is FastAPI's
    400 "There was an error parsing the body", never the 500 of an escaped RecursionError."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise _json_invalid(exc.pos, exc.msg, exc.doc) from None
    except (RecursionError, ValueError) as exc:  # ValueError: UnicodeDecodeError, digits
        raise HTTPException(400, "There was an error parsing the body") from exc


def _check_encodable(value: Any) -> None:
    """Refuse strings that are not Unicode text (a lone surrogate from a `\\ud800` escape).

    Pydantic's parser refuses them; Python's lets them through, and FastAPI then failed
    with a 500 wherever the text was encoded (the tokenizer, the store, the answer).
    """
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError as exc:
        raise _json_invalid(0, "a string holds a lone surrogate", "") from exc


def agent_handler(route: APIRoute) -> Handler:
    """The per-request function of `route` (see the module docstring for what it serves)."""
    plan = _plan(route)
    endpoint = route.endpoint
    if not inspect.iscoroutinefunction(endpoint):
        raise _refuse(route, "the endpoint is not `async def`")
    response_model, default_status = route.response_model, route.status_code

    async def parse(request: Request) -> tuple[BaseModel | None, RequestValidationError | None]:
        """The validated body, or the error to raise once the dependencies have run.

        Validation goes straight from the bytes; a body it refuses is decoded and checked
        again by FastAPI's own field, so that the error a client gets is FastAPI's, word
        for word (pydantic words some errors differently when it reads JSON itself).
        """
        try:
            raw = await request.body()
        except (HTTPException, APIError):  # a body limit's 413, as FastAPI lets it through
            raise
        except Exception as exc:  # the client gone mid-body, say: FastAPI's 400, not a 500
            raise HTTPException(400, "There was an error parsing the body") from exc
        if not raw:
            return None, RequestValidationError([get_missing_field_error(loc=("body",))])
        assert plan.body_model is not None and plan.body_field is not None
        value: Any = raw  # without a JSON content type FastAPI validates the bytes, in vain
        if _is_json(request.headers.get("content-type")):
            try:
                return plan.body_model.model_validate_json(raw), None
            except ValidationError:
                pass
            value = _decode(raw)
        validated, errors = plan.body_field.validate(value, {}, loc=("body",))
        if not errors:  # JSON that only Python's parser reads (a BOM, UTF-16), as FastAPI does
            _check_encodable(value)
            return validated, None
        return None, RequestValidationError(errors, body=value)

    async def handle(request: Request) -> Response:
        body = error = None
        if plan.body_field is not None:
            body, error = await parse(request)
        values: dict[str, Any] = {}
        for name, call in plan.dependencies:
            value = await call(request)
            if name is not None:
                values[name] = value
        for name in plan.path_names:
            values[name] = request.path_params[name]
        if error is not None:
            raise error
        if plan.body_field is not None:
            values[plan.body_field.name] = body
        if plan.request_name is not None:
            values[plan.request_name] = request
        sub = None
        if plan.response_name is not None:
            sub = Response()
            del sub.headers["content-length"]
            sub.status_code = 0  # unset: falls back to the route's status below
            values[plan.response_name] = sub
        result = await endpoint(**values)
        if isinstance(result, Response):
            return result
        status = (sub.status_code if sub is not None else None) or default_status or 200
        if route.response_field is None:
            response: Response = JSONResponse(jsonable_encoder(result), status_code=status)
        else:
            if type(result) is response_model:  # FastAPI would validate it again, unchanged
                content = result.model_dump_json(by_alias=True).encode()
            else:
                content = await serialize_response(
                    field=route.response_field, response_content=result, dump_json=True
                )
            response = Response(content, status_code=status, media_type="application/json")
        if sub is not None:
            response.headers.raw.extend(sub.headers.raw)
        return response

    return handle
