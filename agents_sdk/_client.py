"""RLGate and AsyncRLGate: episodes, groups and rewards against an rlgate gateway.

The twins share `BaseGate`; each one only sends (with retries) and builds its own OpenAI
client. A typical agent loop:

    gate = RLGate("http://127.0.0.1:8000/v1", api_key)
    episode = gate.episode()
    reply = episode.openai().chat.completions.create(model=run_name, messages=...)
    episode.reward(1.0)
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Generic, Self, TypeVar

import httpx
import openai

from agents_sdk._base import (
    DEFAULT_BACKOFF,
    DEFAULT_MAX_RETRIES,
    DEFAULT_TIMEOUT,
    BaseGate,
    RewardAck,
    check_id,
    new_episode_id,
    new_group_id,
)
from agents_sdk._exceptions import APIConnectionError, APITimeoutError

GateT = TypeVar("GateT", "RLGate", "AsyncRLGate")


def _connection_error(exc: httpx.TransportError) -> APIConnectionError:
    cls = APITimeoutError if isinstance(exc, httpx.TimeoutException) else APIConnectionError
    return cls(f"could not reach the gateway: {exc!r}")


class _EpisodeBase(Generic[GateT]):
    def __init__(self, gate: GateT, episode_id: str | None, group_id: str | None) -> None:
        self.gate = gate
        self.id = check_id("episode_id", new_episode_id() if episode_id is None else episode_id)
        self.group_id = None if group_id is None else check_id("group_id", group_id)
        # Every OpenAI call made against this URL is filed under this episode (and group).
        self.base_url = gate.scoped_base_url(self.id, self.group_id)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, group_id={self.group_id!r})"


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
        transport = self.gate.transport
        if transport is not None and "http_client" not in kwargs:
            kwargs["http_client"] = httpx.Client(transport=transport)
        return openai.OpenAI(base_url=self.base_url, api_key=self.gate.api_key, **kwargs)

    def reward(self, value: float, idempotency_key: str | None = None) -> RewardAck:
        """Reward the whole episode."""
        return self.gate.reward(value, episode_id=self.id, idempotency_key=idempotency_key)

    def reward_completion(
        self, completion_id: str, value: float, idempotency_key: str | None = None
    ) -> RewardAck:
        """Reward one completion (a `chatcmpl-...` id) of this episode."""
        return self.gate.reward(value, completion_id=completion_id, idempotency_key=idempotency_key)


class Group(_GroupBase["RLGate"]):
    """Episodes that share a group id, e.g. several attempts at one task (GRPO's group)."""

    def episode(self, episode_id: str | None = None) -> Episode:
        return Episode(self.gate, episode_id, self.id)


class RLGate(BaseGate):
    """A synchronous client for one run of an rlgate gateway.

    `base_url` is the OpenAI base URL (`http://host:port/v1`), `api_key` the run's agent key.
    Reward posts are retried `max_retries` times on connection errors, 429 and 5xx, with
    exponential backoff starting at `backoff` seconds; `transport` replaces the network
    (an `httpx.MockTransport` in tests) for rewards and for the clients `Episode.openai` builds.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        transport: httpx.BaseTransport | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        backoff: float = DEFAULT_BACKOFF,
    ) -> None:
        super().__init__(
            base_url, api_key, timeout=timeout, max_retries=max_retries, backoff=backoff
        )
        self.transport = transport
        self._http = httpx.Client(transport=transport, **self._client_kwargs())

    def episode(self, episode_id: str | None = None, group_id: str | None = None) -> Episode:
        """A new episode; `episode_id` defaults to a fresh `ep-<uuid>`."""
        return Episode(self, episode_id, group_id)

    def group(self, group_id: str | None = None) -> Group:
        """A new group; `group_id` defaults to a fresh `grp-<uuid>`."""
        return Group(self, group_id)

    def reward(
        self,
        value: float,
        *,
        completion_id: str | None = None,
        episode_id: str | None = None,
        idempotency_key: str | None = None,
    ) -> RewardAck:
        """Post a reward for exactly one of a completion or an episode."""
        body = self.reward_body(
            value,
            completion_id=completion_id,
            episode_id=episode_id,
            idempotency_key=idempotency_key,
        )
        request = self._http.build_request("POST", self.base_url + "/rewards", json=body)
        return self.parse_reward(self._send(request))

    def _send(self, request: httpx.Request) -> httpx.Response:
        attempt = 0
        while True:
            response: httpx.Response | None = None
            try:
                response = self._http.send(request)
            except httpx.TransportError as exc:
                if not self.should_retry(attempt, None):
                    raise _connection_error(exc) from exc
            else:
                if not self.should_retry(attempt, response):
                    return response
                response.close()
            time.sleep(self.retry_delay(attempt, response))
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
        transport = self.gate.transport
        if transport is not None and "http_client" not in kwargs:
            kwargs["http_client"] = httpx.AsyncClient(transport=transport)
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.gate.api_key, **kwargs)

    async def reward(self, value: float, idempotency_key: str | None = None) -> RewardAck:
        """Reward the whole episode."""
        return await self.gate.reward(value, episode_id=self.id, idempotency_key=idempotency_key)

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


class AsyncRLGate(BaseGate):
    """The async twin of `RLGate`; `transport` must be an `httpx.AsyncBaseTransport`."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        backoff: float = DEFAULT_BACKOFF,
    ) -> None:
        super().__init__(
            base_url, api_key, timeout=timeout, max_retries=max_retries, backoff=backoff
        )
        self.transport = transport
        self._http = httpx.AsyncClient(transport=transport, **self._client_kwargs())

    def episode(self, episode_id: str | None = None, group_id: str | None = None) -> AsyncEpisode:
        """A new episode; `episode_id` defaults to a fresh `ep-<uuid>`."""
        return AsyncEpisode(self, episode_id, group_id)

    def group(self, group_id: str | None = None) -> AsyncGroup:
        """A new group; `group_id` defaults to a fresh `grp-<uuid>`."""
        return AsyncGroup(self, group_id)

    async def reward(
        self,
        value: float,
        *,
        completion_id: str | None = None,
        episode_id: str | None = None,
        idempotency_key: str | None = None,
    ) -> RewardAck:
        """Post a reward for exactly one of a completion or an episode."""
        body = self.reward_body(
            value,
            completion_id=completion_id,
            episode_id=episode_id,
            idempotency_key=idempotency_key,
        )
        request = self._http.build_request("POST", self.base_url + "/rewards", json=body)
        return self.parse_reward(await self._send(request))

    async def _send(self, request: httpx.Request) -> httpx.Response:
        attempt = 0
        while True:
            response: httpx.Response | None = None
            try:
                response = await self._http.send(request)
            except httpx.TransportError as exc:
                if not self.should_retry(attempt, None):
                    raise _connection_error(exc) from exc
            else:
                if not self.should_retry(attempt, response):
                    return response
                await response.aclose()
            await asyncio.sleep(self.retry_delay(attempt, response))
            attempt += 1

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
