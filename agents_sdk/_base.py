"""Construction, request building, retry policy and response parsing shared by the twin clients.

Nothing here sends or sleeps, so `RLGate` and `AsyncRLGate` differ only in how they do those.
"""

from __future__ import annotations

import contextlib
import math
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypedDict, TypeVar
from urllib.parse import quote

import httpx

from agents_sdk._exceptions import APIResponseError, connection_error, status_error

DEFAULT_TIMEOUT = 60.0
DEFAULT_MAX_RETRIES = 2
DEFAULT_BACKOFF = 0.5
MAX_BACKOFF = 8.0
MAX_ID_LENGTH = 100  # the gateway stores episode and group ids in VARCHAR(100)

TransportT = TypeVar("TransportT", httpx.BaseTransport, httpx.AsyncBaseTransport)
HttpT = TypeVar("HttpT", httpx.Client, httpx.AsyncClient)
EpisodeT = TypeVar("EpisodeT")
GroupT = TypeVar("GroupT")


@dataclass(frozen=True)
class RewardAck:
    """The gateway's answer to a reward post."""

    id: int
    run_id: str
    completion_id: str | None
    episode_id: str
    reward: float
    episode_status: str
    # True when the idempotency key had been seen: this post was not stored again.
    duplicate: bool = False
    policy: str | None = None  # a policy-scoped reward's policy (docs/policies.md)
    # Where the run, the episode and its group stand now (GET /v1/runs/self's answer):
    # version, next_step (ready_groups, groups_per_step), admission, episode, group.
    progress: dict[str, Any] | None = None


class RewardTarget(TypedDict, total=False):
    """What a reward post names: exactly one of the two ids, an optional policy (with an
    episode id, on a run with policies) and an optional idempotency key."""

    completion_id: str | None
    episode_id: str | None
    policy: str | None
    idempotency_key: str | None


def new_episode_id() -> str:
    return "ep-" + uuid.uuid4().hex


def new_group_id() -> str:
    return "grp-" + uuid.uuid4().hex


def check_id(kind: str, value: str) -> str:
    """Reject, before anything is sent, the ids the gateway refuses (its one rule is
    `gateway/identifiers.py`; tests/api/test_agents_sdk_gateway.py keeps the two in step)."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{kind} must be a non-empty string, got {value!r}")
    if len(value) > MAX_ID_LENGTH:
        raise ValueError(f"{kind} is longer than {MAX_ID_LENGTH} characters")
    if not value.isprintable():
        raise ValueError(f"{kind} {value!r} has a control, format or separator character")
    # Starlette routes on the decoded path, so even an escaped "/" would split the segment.
    if "/" in value or value in (".", ".."):
        raise ValueError(f"{kind} {value!r} cannot be used in a URL path")
    if value.startswith("~"):
        raise ValueError(f"{kind} {value!r} starts with '~', which the gateway reserves")
    return value


class BaseGate(Generic[TransportT, HttpT, EpisodeT, GroupT]):
    """Configuration, the httpx client, and pure helpers; subclasses send, sleep and name
    their own episode and group classes."""

    # Called as `(gate, episode_id, group_id)` and `(gate, group_id)`.
    _episode_class: Callable[..., EpisodeT]
    _group_class: Callable[..., GroupT]

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        transport: TransportT | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        backoff: float = DEFAULT_BACKOFF,
    ) -> None:
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        url = base_url.rstrip("/")
        # Accept the OpenAI-style ".../v1" as well as the bare gateway root.
        self.root = url.removesuffix("/v1")
        self.base_url = self.root + "/v1"
        self.api_key = api_key
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.transport = transport
        self._http = self._open(transport)

    def _open(self, transport: TransportT | None) -> HttpT:
        """The httpx client (sync or async) that reward posts go through."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(base_url={self.base_url!r})"

    def _client_kwargs(self) -> dict[str, Any]:
        return {
            "headers": {
                "Authorization": f"Bearer {self.api_key}",
                "User-Agent": "rlgate-agents-sdk",
            },
            "timeout": self.timeout,
        }

    def episode(self, episode_id: str | None = None, group_id: str | None = None) -> EpisodeT:
        """A new episode; `episode_id` defaults to a fresh `ep-<uuid>`."""
        return self._episode_class(self, episode_id, group_id)

    def evaluation(
        self,
        episode_id: str | None = None,
        group_id: str | None = None,
        *,
        version: int | None = None,
    ) -> EpisodeT:
        """A new held-out episode: its calls go under `/eval` (served and scored, never
        trained); `version` pins a kept version (`X-Rlgate-Version`), else the run's current."""
        return self._episode_class(self, episode_id, group_id, evaluation=True, version=version)

    def group(self, group_id: str | None = None) -> GroupT:
        """A new group; `group_id` defaults to a fresh `grp-<uuid>`."""
        return self._group_class(self, group_id)

    def scoped_base_url(
        self, episode_id: str, group_id: str | None, *, evaluation: bool = False
    ) -> str:
        """The OpenAI base URL that files every call under this episode (and group);
        `evaluation`: under `/eval`, as a held-out episode."""
        path = f"/episodes/{quote(episode_id, safe='')}/v1"
        if group_id is not None:
            path = f"/groups/{quote(group_id, safe='')}" + path
        return self.root + "/eval" * evaluation + path

    def reward_body(
        self,
        value: float,
        *,
        completion_id: str | None,
        episode_id: str | None,
        idempotency_key: str | None,
        policy: str | None = None,
    ) -> dict[str, Any]:
        """The JSON of a reward post; a fresh idempotency key makes the post safe to retry."""
        if (completion_id is None) == (episode_id is None):
            raise ValueError("give exactly one of completion_id or episode_id")
        if policy is not None and episode_id is None:
            raise ValueError("policy goes with episode_id: a completion's reward is its policy's")
        reward = float(value)
        if not math.isfinite(reward):
            raise ValueError(f"reward must be a finite number, got {value!r}")
        body: dict[str, Any] = {"reward": reward}
        if completion_id is not None:
            body["completion_id"] = completion_id
        else:
            body["episode_id"] = episode_id
        if policy is not None:
            body["policy"] = policy
        body["idempotency_key"] = idempotency_key or uuid.uuid4().hex
        return body

    def reward_request(
        self,
        value: float,
        *,
        completion_id: str | None = None,
        episode_id: str | None = None,
        idempotency_key: str | None = None,
        policy: str | None = None,
    ) -> httpx.Request:
        """The reward post, with the client's headers and timeout, ready to send."""
        body = self.reward_body(
            value,
            completion_id=completion_id,
            episode_id=episode_id,
            idempotency_key=idempotency_key,
            policy=policy,
        )
        return self._http.build_request("POST", self.base_url + "/rewards", json=body)

    def should_retry(self, attempt: int, response: httpx.Response | None) -> bool:
        """Retry a lost request or a 429/5xx, never another 4xx, at most `max_retries` times."""
        if attempt >= self.max_retries:
            return False
        return response is None or response.status_code == 429 or response.status_code >= 500

    def retry_delay(self, attempt: int, response: httpx.Response | None) -> float:
        """Exponential backoff with jitter, or the server's Retry-After if it asks for longer."""
        delay = self.backoff * (2**attempt) * random.uniform(0.5, 1.0)
        if response is not None:
            # Absent, or an HTTP date rather than seconds: keep our own backoff.
            with contextlib.suppress(ValueError):
                delay = max(delay, float(response.headers.get("retry-after", "")))
        return min(delay, MAX_BACKOFF)

    def settle(
        self, attempt: int, outcome: httpx.Response | httpx.TransportError
    ) -> httpx.Response | float:
        """After attempt number `attempt`: the response to return, or the seconds to sleep
        before the next attempt; a transport error that is not retried is raised as ours."""
        response = outcome if isinstance(outcome, httpx.Response) else None
        if self.should_retry(attempt, response):
            return self.retry_delay(attempt, response)
        if isinstance(outcome, httpx.TransportError):
            raise connection_error(outcome) from outcome
        return outcome

    @staticmethod
    def parse_reward(response: httpx.Response) -> RewardAck:
        if response.is_error:
            raise status_error(response)
        try:
            data = response.json()
            return RewardAck(
                id=data["id"],
                run_id=data["run_id"],
                completion_id=data.get("completion_id"),
                episode_id=data["episode_id"],
                reward=data["reward"],
                episode_status=data["episode_status"],
                duplicate=data.get("duplicate", False),
                progress=data.get("progress"),
                policy=data.get("policy"),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise APIResponseError(
                f"unexpected reward response: {response.text[:200]!r}", response=response
            ) from exc
