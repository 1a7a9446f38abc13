"""RLGate and AsyncRLGate: episodes, groups and rewards against an rlgate gateway.

The twins share `BaseGate`; each one only sends (with retries), sleeps and builds its own
OpenAI client. A typical agent loop:

    gate = RLGate("http://127.0.0.1:8000/v1", api_key)
    episode = gate.episode()
    reply = episode.openai().chat.completions.create(model=run_name, messages=...)
    episode.reward(1.0)
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Generic, Self, TypeVar, Unpack

import httpx
import openai

from agents_sdk._base import (
    BaseGate,
    RewardAck,
    RewardTarget,
    check_id,
    new_episode_id,
    new_group_id,
)

GateT = TypeVar("GateT", "RLGate", "AsyncRLGate")


class _EpisodeBase(Generic[GateT]):
    def __init__(
        self,
        gate: GateT,
        episode_id: str | None,
        group_id: str | None,
        *,
        evaluation: bool = False,
        version: int | None = None,
    ) -> None:
        """`evaluation`: a held-out episode (`RLGate.evaluation`); `version`: the kept version
        its calls pin."""
        if version is not None and (not evaluation or version < 0):
            raise ValueError("version pins a held-out episode only, and is >= 0")
        self.gate = gate
        self.id = check_id("episode_id", new_episode_id() if episode_id is None else episode_id)
        self.group_id = None if group_id is None else check_id("group_id", group_id)
        self.evaluation = evaluation
        self.version = version
        # Every OpenAI call made against this URL is filed under this episode (and group).
        self.base_url = gate.scoped_base_url(self.id, self.group_id, evaluation=evaluation)

    def __repr__(self) -> str:
        held_out = ", evaluation=True" if self.evaluation else ""
        return f"{type(self).__name__}(id={self.id!r}, group_id={self.group_id!r}{held_out})"

    def _openai_kwargs(self, kwargs: dict[str, Any], http_class: type) -> dict[str, Any]:
        """Arguments for an OpenAI client filed under this episode, on the gate's transport."""
        transport = self.gate.transport
        if transport is not None and "http_client" not in kwargs:
            kwargs["http_client"] = http_class(transport=transport)
        if self.version is not None:
            pin = {"X-Rlgate-Version": str(self.version)}
            kwargs["default_headers"] = {**pin, **(kwargs.get("default_headers") or {})}
        return {"base_url": self.base_url, "api_key": self.gate.api_key, **kwargs}


class _GroupBase(Generic[GateT]):
    def __init__(self, gate: GateT, group_id: str | None) -> None:
        self.gate = gate
        self.id = check_id("group_id", new_group_id() if group_id is None else group_id)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r})"


# --- sync ---------------------------------------------------------------------------------


class Episode(_EpisodeBase["RLGate"]):
    """One agent attempt: its calls go through `base_url`, its outcome through `reward`."""

    def openai(self, **kwargs: Any) -> openai.OpenAI:
        """An OpenAI client filed under this episode; build it once per episode and reuse it.

        `kwargs` go to `openai.OpenAI` (e.g. `timeout`, `max_retries`).
        """
        return openai.OpenAI(**self._openai_kwargs(kwargs, httpx.Client))

    def reward(
        self, value: float, idempotency_key: str | None = None, policy: str | None = None
    ) -> RewardAck:
        """Reward the whole episode (`policy`: that policy's turns only, docs/policies.md)."""
        return self.gate.reward(
            value, episode_id=self.id, idempotency_key=idempotency_key, policy=policy
        )

    def reward_completion(
        self, completion_id: str, value: float, idempotency_key: str | None = None
    ) -> RewardAck:
        """Reward one completion (a `chatcmpl-...` id) of this episode."""
        return self.gate.reward(value, completion_id=completion_id, idempotency_key=idempotency_key)


class Group(_GroupBase["RLGate"]):
    """Episodes that share a group id, e.g. several attempts at one task (GRPO's group)."""

    def episode(self, episode_id: str | None = None) -> Episode:
        return Episode(self.gate, episode_id, self.id)


class RLGate(BaseGate[httpx.BaseTransport, httpx.Client, Episode, Group]):
    """A synchronous client for one run of an rlgate gateway.

    `base_url` is the OpenAI base URL (`http://host:port/v1`), `api_key` the run's agent key.
    Reward posts are retried `max_retries` times on connection errors, 429 and 5xx, with
    exponential backoff starting at `backoff` seconds; `transport` replaces the network
    (an `httpx.MockTransport` in tests) for rewards and for the clients `Episode.openai` builds.
    """

    _episode_class = Episode
    _group_class = Group

    def _open(self, transport: httpx.BaseTransport | None) -> httpx.Client:
        return httpx.Client(transport=transport, **self._client_kwargs())

    def reward(self, value: float, **target: Unpack[RewardTarget]) -> RewardAck:
        """Post a reward for exactly one of a completion or an episode (`completion_id=` or
        `episode_id=`), with an optional `idempotency_key=`."""
        return self.parse_reward(self._send(self.reward_request(value, **target)))

    def _send(self, request: httpx.Request) -> httpx.Response:
        attempt = 0
        while True:
            try:
                outcome: httpx.Response | httpx.TransportError = self._http.send(request)
            except httpx.TransportError as exc:
                outcome = exc
            step = self.settle(attempt, outcome)
            if isinstance(step, httpx.Response):
                return step
            time.sleep(step)
            attempt += 1

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# --- async --------------------------------------------------------------------------------


class AsyncEpisode(_EpisodeBase["AsyncRLGate"]):
    """The async twin of `Episode`."""

    def openai(self, **kwargs: Any) -> openai.AsyncOpenAI:
        """An AsyncOpenAI client filed under this episode; `kwargs` go to `openai.AsyncOpenAI`."""
        return openai.AsyncOpenAI(**self._openai_kwargs(kwargs, httpx.AsyncClient))

    async def reward(
        self, value: float, idempotency_key: str | None = None, policy: str | None = None
    ) -> RewardAck:
        """Reward the whole episode (`policy`: that policy's turns only, docs/policies.md)."""
        return await self.gate.reward(
            value, episode_id=self.id, idempotency_key=idempotency_key, policy=policy
        )

    async def reward_completion(
        self, completion_id: str, value: float, idempotency_key: str | None = None
    ) -> RewardAck:
        """Reward one completion (a `chatcmpl-...` id) of this episode."""
        return await self.gate.reward(
            value, completion_id=completion_id, idempotency_key=idempotency_key
        )


class AsyncGroup(_GroupBase["AsyncRLGate"]):
    """The async twin of `Group`."""

    def episode(self, episode_id: str | None = None) -> AsyncEpisode:
        return AsyncEpisode(self.gate, episode_id, self.id)


class AsyncRLGate(BaseGate[httpx.AsyncBaseTransport, httpx.AsyncClient, AsyncEpisode, AsyncGroup]):
    """The async twin of `RLGate`; `transport` must be an `httpx.AsyncBaseTransport`."""

    _episode_class = AsyncEpisode
    _group_class = AsyncGroup

    def _open(self, transport: httpx.AsyncBaseTransport | None) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=transport, **self._client_kwargs())

    async def reward(self, value: float, **target: Unpack[RewardTarget]) -> RewardAck:
        """Post a reward for exactly one of a completion or an episode (`completion_id=` or
        `episode_id=`), with an optional `idempotency_key=`."""
        return self.parse_reward(await self._send(self.reward_request(value, **target)))

    async def _send(self, request: httpx.Request) -> httpx.Response:
        attempt = 0
        while True:
            try:
                outcome: httpx.Response | httpx.TransportError = await self._http.send(request)
            except httpx.TransportError as exc:
                outcome = exc
            step = self.settle(attempt, outcome)
            if isinstance(step, httpx.Response):
                return step
            await asyncio.sleep(step)
            attempt += 1

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
