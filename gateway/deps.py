"""FastAPI dependencies and the checks routers share: caller's run, admin, model, episode, login."""

from __future__ import annotations

import logging
from typing import Annotated, Protocol

from fastapi import Depends, Path, Request

from core.store.models import Run
from gateway.agent.episodes import EVAL_PREFIX, VERSION_HEADER, EpisodeRef
from gateway.dashboard.auth import LoginRequired, Session, active_session, require_session
from gateway.errors import AuthenticationFailed, InvalidRequest
from gateway.identifiers import id_from_header
from gateway.keys import DEV_KEY_OFF_LOOPBACK, admin_key_matches, dev_key_refused
from gateway.middleware.identity import authenticated_run, identity_of

logger = logging.getLogger(__name__)


class AgentRequest(Protocol):
    """A chat, text completion or Responses request body, as `check_request` reads it."""

    model: str

    def unknown_fields(self) -> list[str]: ...


def _bearer(request: Request) -> str:
    """The caller's key, from its one identity (`middleware.identity`: Bearer or `x-api-key`)."""
    return identity_of(request.scope).required_key()


async def current_run(request: Request) -> Run:
    """The run whose agent key the caller presented (revoked keys do not count).

    Looked up once per request through the app's `RunKeyCache` (see there for when a
    change is seen); a sampling call's was looked up by `AgentKeyCheck` already.
    """
    return await authenticated_run(request.app.state, request.scope)


async def require_admin(request: Request) -> None:
    if not admin_key_matches(_bearer(request), request.app.state.admin_key):
        raise AuthenticationFailed("admin credential required", code="invalid_admin_key")
    if dev_key_refused(request.app.state.admin_key, request.client and request.client.host):
        raise AuthenticationFailed(DEV_KEY_OFF_LOOPBACK, code="dev_admin_key_off_loopback")


async def check_request(request: Request, run: Run, body: AgentRequest, kind: str) -> Run:
    """What every agent request gets first: unknown fields logged and ignored (as OpenAI's
    clients send fields before rlgate knows them), then its `model` checked against the key's
    run (its name, its model as given, or its id) or, where the run declares policies,
    resolved to the policy's run (`gateway.agent.policies`). Returns the run that serves it."""
    if body.unknown_fields():
        logger.info("ignoring unknown %s fields: %s", kind, body.unknown_fields())
    return await request.app.state.policies.serving_run(run, body.model)


async def episode_ref(request: Request) -> EpisodeRef:
    """Path first, then headers; the service falls back to `metadata`, then prefix matching.

    Dependencies here are `async def` though they never wait: FastAPI runs a plain `def`
    dependency in a worker thread, a thread hop (and GIL hand-off) on every agent call.
    """
    p, h = request.path_params, request.headers
    evaluation = request.scope["path"].startswith(EVAL_PREFIX + "/")
    return EpisodeRef(
        episode_id=p.get("episode_id") or id_from_header(h.get("x-episode-id"), "episode_id"),
        group_id=p.get("group_id") or id_from_header(h.get("x-group-id"), "group_id"),
        source="path" if p.get("episode_id") else "header",
        evaluation=evaluation,
        version=pinned_version(h.get(VERSION_HEADER), evaluation),
    )


def pinned_version(value: str | None, evaluation: bool) -> int | None:
    """The `X-Rlgate-Version` an evaluation call pins (None: the run's current version).

    Training calls are always sampled by the serving version (the staleness bound counts
    from it), so a pin outside `/eval` is a 400, as is a value that is not a version number.
    """
    if value is None:
        return None
    if not evaluation:
        raise InvalidRequest(
            f"{VERSION_HEADER} pins evaluation calls only: send the call under {EVAL_PREFIX}/v1",
            code="version_pin_not_evaluation",
        )
    if not (value.isascii() and value.isdigit()) or len(value) > 9:
        raise InvalidRequest(
            f"{VERSION_HEADER} must be a version number (0, 1, 2, ...), not {value[:40]!r}",
            code="invalid_version_pin",
        )
    return int(value)


async def agent_base_url(request: Request) -> str:
    """The `base_url` an agent is given: the configured public URL, else the one called."""
    public = request.app.state.settings.public_url
    base = public.rstrip("/") if public else str(request.base_url).rstrip("/")
    return base + "/v1"


async def dashboard_page(request: Request) -> Session:
    """A dashboard page's session; without one the browser goes to the login form."""
    session = await active_session(request)
    if session is None:
        raise LoginRequired
    return session


RunDep = Annotated[Run, Depends(current_run)]
# Key ids are 32-bit integers in the store: a larger one is a 400, not a database error.
KeyId = Annotated[int, Path(ge=1, le=2**31 - 1)]
AdminDep = Depends(require_admin)
EpisodeRefDep = Annotated[EpisodeRef, Depends(episode_ref)]
AgentBaseUrlDep = Annotated[str, Depends(agent_base_url)]
PageSessionDep = Depends(dashboard_page)
FeedSessionDep = Depends(require_session)  # a poller has no form to go to: 401, no redirect
