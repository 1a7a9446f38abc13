"""The caller's one identity: its key, read once per request from whichever header carried it.

Authentication (`gateway.deps`), quotas (`QuotaMiddleware`), overload slots
(`OverloadMiddleware`) and log lines all read the `Identity` that
`IdentityMiddleware` stores in `scope["state"]`, so a key counts the same
whatever header form the client used.

Header forms: `Authorization: Bearer <key>` (OpenAI) and `x-api-key: <key>`
(Anthropic). A request that carries two different keys, across those headers
or in a repeated one, is refused with 401 before anything else reads it:
otherwise one part of the gateway could authenticate the first and another
meter the second. Identical copies are one key.

`AgentKeyCheck` validates the key of a sampling call against the store (via
`RunKeyCache`) before the call may take an overload slot or have its body
read: a missing or invalid key is answered 401 at once, its body unread and
its connection closed.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.types import ASGIApp, Receive, Scope, Send

from core.store.keys import run_for_key_hash
from core.store.models import Run
from gateway.errors import APIError, AuthenticationFailed, database_failure, error_response
from gateway.keys import display_prefix, hash_key

SAMPLING_SUFFIXES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")


def is_sampling_call(scope: Scope) -> bool:
    """A POST to a sampling endpoint, under any episode prefix: what takes an overload slot."""
    return (
        scope["type"] == "http"
        and scope["method"] == "POST"
        and scope["path"].endswith(SAMPLING_SUFFIXES)
    )


_MISSING = (
    "missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
    "missing_api_key",
)


@dataclass(frozen=True)
class Identity:
    """The key a request presented (None: none), and what gateway parts key on."""

    key: str | None
    key_hash: str | None

    @property
    def label(self) -> str:
        """What logs show of the caller: the key's display prefix, never the key."""
        return display_prefix(self.key) if self.key else "anonymous"

    def required_key(self) -> str:
        if self.key is None:
            raise AuthenticationFailed(_MISSING[0], code=_MISSING[1])
        return self.key

    def required_hash(self) -> str:
        """The key's hash (what the store and the quotas key on); 401 without a key."""
        if self.key_hash is None:
            raise AuthenticationFailed(_MISSING[0], code=_MISSING[1])
        return self.key_hash


ANONYMOUS = Identity(None, None)


def resolve(headers: list[tuple[bytes, bytes]] | tuple) -> Identity:
    """The one key of a request's raw headers; AuthenticationFailed if two disagree."""
    keys: set[str] = set()
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():  # other schemes are not ours
                keys.add(token.strip())
        elif name == b"x-api-key" and value.strip():
            keys.add(value.decode("latin-1").strip())
    if len(keys) > 1:
        raise AuthenticationFailed(
            "conflicting API keys: send one key, in one header", code="conflicting_api_keys"
        )
    if not keys:
        return ANONYMOUS
    (key,) = keys
    return Identity(key, hash_key(key))


def identity_of(scope: Scope) -> Identity:
    """The identity `IdentityMiddleware` stored (resolved here for a scope it never saw)."""
    state = scope.setdefault("state", {})
    found = state.get("identity")
    if found is None:
        found = state["identity"] = resolve(scope.get("headers") or ())
    return found


class IdentityMiddleware:
    """Resolves the caller's key once; conflicting keys are a 401 in the API family's shape."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:
                scope.setdefault("state", {})["identity"] = resolve(scope.get("headers") or ())
            except APIError as exc:
                await _refuse(exc, scope, receive, send)
                return
        await self.app(scope, receive, send)


async def lookup_run(state, key_hash: str) -> Run | None:
    """The run of an agent key (revoked keys: None), through the app's `RunKeyCache`."""

    async def load() -> Run | None:
        async with state.sessions() as s:
            return await run_for_key_hash(s, key_hash)

    return await state.run_keys.get_or_load(key_hash, load)


async def authenticated_run(state, scope: Scope) -> Run:
    """The caller's run, looked up once per request (`AgentKeyCheck` may have done it)."""
    run = scope.get("state", {}).get("run")
    if run is not None:
        return run
    key_hash = identity_of(scope).required_hash()
    try:
        run = await lookup_run(state, key_hash)
    except (DBAPIError, PoolTimeout) as exc:  # also raised outside the app's handlers
        err = database_failure(exc)
        if err is None:
            raise
        raise err from exc
    if run is None:
        raise AuthenticationFailed("invalid API key", code="invalid_api_key")
    scope["state"]["run"] = run
    return run


class AgentKeyCheck:
    """A sampling call's key validated before its slot and its body: 401 at once otherwise."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not is_sampling_call(scope):
            await self.app(scope, receive, send)
            return
        try:
            await authenticated_run(scope["app"].state, scope)
        except APIError as exc:  # a wrong key's 401, the database's 503
            await _refuse(exc, scope, receive, send)
            return
        await self.app(scope, receive, send)


async def _refuse(exc: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    """`exc` answered without reading the body; a connection whose body is unread is closed
    (reading it only to skip it would let a caller hold the connection for free)."""
    response = error_response(exc, scope["path"])
    headers = dict(scope.get("headers") or ())
    if headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers:
        response.headers["connection"] = "close"
    await response(scope, receive, send)
