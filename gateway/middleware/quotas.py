"""Per-key rate limits (requests per minute) and token quotas (tokens per UTC day) in Redis.

Off unless `quota_redis_url` is set. A key's limits are its own (set through
the admin API, stored in Redis next to its counters; a rotated key's new
hash inherits them) or else the settings' defaults. Keys are identified by
the SHA-256 of the agent key, as in the store, so the check needs no extra
database round trip. The key is the caller's one identity
(`gateway.middleware.identity`: Bearer or `x-api-key`, conflicting keys refused), and
only a valid key is counted: a wrong key counts against no run.

Requests: a fixed one-minute window per key (`INCR` + `EXPIRE`); the call that
goes over gets 429 with `Retry-After` = seconds to the next window. Tokens: a
per-day counter of prompt + output tokens, added after each call from what
the gateway itself stored for it (`gateway.agent.capture.StoredTokens`:
each stored completion's prompt and output token ids, so an `n = 2` call
counts its prompt twice, as it stored it twice); every endpoint, streamed or
not, is metered the same way and no response is parsed. Once the day's count
reaches the quota, calls get 429 until the next UTC midnight. A call that
starts under the quota finishes, so a day may end slightly over it.

Answers to a key with limits carry OpenAI's headers, on 200s and 429s alike:
`x-ratelimit-limit-requests`, `x-ratelimit-remaining-requests`,
`x-ratelimit-reset-requests` (with a request limit) and the `-tokens` trio
(with a token quota); resets are written as OpenAI does (`59s`, `6m0s`).

If Redis cannot be reached the gateway serves anyway (fails open) and logs it:
a quota outage must not take the API down.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.agent.capture import StoredTokens, stored_tokens
from gateway.errors import APIError, RateLimited, error_response
from gateway.middleware.identity import authenticated_run, identity_of

logger = logging.getLogger(__name__)

DAY_S = 86400
# Agent endpoints: /v1/..., /episodes/{id}/v1/..., /groups/{g}/episodes/{id}/v1/..., and each
# of them under /eval/ (held-out calls are metered as any other).
AGENT_PREFIXES = ("/v1/", "/episodes/", "/groups/", "/eval/")


@dataclass(frozen=True)
class Limits:
    requests_per_min: int | None = None
    tokens_per_day: int | None = None


@dataclass(frozen=True)
class QuotaUsage:
    """A key's counts in the current minute and UTC day."""

    requests_this_min: int
    tokens_today: int


@dataclass(frozen=True)
class Standing:
    """A key's limits and its counts as of one admitted (or refused) call."""

    limits: Limits
    requests_this_min: int
    tokens_today: int
    now: float


class OverQuota(Exception):
    """A call over a limit: the 429 to answer and the standing for its headers."""

    def __init__(self, error: RateLimited, standing: Standing) -> None:
        super().__init__(error.message)
        self.error, self.standing = error, standing


class QuotaService:
    def __init__(self, client: aioredis.Redis, prefix: str, defaults: Limits) -> None:
        self.redis = client
        self.prefix = prefix
        self.defaults = defaults

    @classmethod
    def from_url(cls, url: str, prefix: str, defaults: Limits) -> QuotaService:
        client = aioredis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        return cls(client, prefix, defaults)

    def _k(self, *parts: object) -> str:
        return self.prefix + ":".join(str(p) for p in parts)

    async def set_limits(self, key_hash: str, limits: Limits) -> None:
        data = {
            "requests_per_min": limits.requests_per_min,
            "tokens_per_day": limits.tokens_per_day,
        }
        await self.redis.set(self._k("limits", key_hash), json.dumps(data))

    async def copy_limits(self, old_hash: str, new_hash: str) -> None:
        """A rotated key's own limits, given to its successor (defaults need no copy)."""
        raw = await self.redis.get(self._k("limits", old_hash))
        if raw is not None:
            await self.redis.set(self._k("limits", new_hash), raw)

    async def limits(self, key_hash: str) -> Limits:
        raw = await self.redis.get(self._k("limits", key_hash))
        if raw is None:
            return self.defaults
        data = json.loads(raw)
        return Limits(data.get("requests_per_min"), data.get("tokens_per_day"))

    async def usage(self, key_hash: str, now: float | None = None) -> QuotaUsage:
        now = time.time() if now is None else now
        req, tok = await self.redis.mget(
            self._k("req", key_hash, int(now // 60)), self._k("tok", key_hash, int(now // DAY_S))
        )
        return QuotaUsage(int(req or 0), int(tok or 0))

    async def admit(self, key_hash: str, now: float | None = None) -> Standing:
        """Count one request; raise OverQuota if the key is over either limit."""
        now = time.time() if now is None else now
        limits = await self.limits(key_hash)
        used = requests = 0
        if limits.tokens_per_day is not None:
            used = int(await self.redis.get(self._k("tok", key_hash, int(now // DAY_S))) or 0)
            if used >= limits.tokens_per_day:
                raise OverQuota(
                    RateLimited(
                        f"token quota of {limits.tokens_per_day} per day used up",
                        retry_after_s=max(1, int(DAY_S - now % DAY_S)),
                        code="quota_exceeded",
                    ),
                    Standing(limits, requests, used, now),
                )
        if limits.requests_per_min is not None:
            window = self._k("req", key_hash, int(now // 60))
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.incr(window)
                pipe.expire(window, 120)
                requests, _ = await pipe.execute()
            if requests > limits.requests_per_min:
                raise OverQuota(
                    RateLimited(
                        f"rate limit of {limits.requests_per_min} requests per minute reached",
                        retry_after_s=max(1, int(60 - now % 60)),
                        code="rate_limit_exceeded",
                    ),
                    Standing(limits, requests, used, now),
                )
        return Standing(limits, requests, used, now)

    async def add_tokens(self, key_hash: str, n: int, now: float | None = None) -> None:
        if n <= 0:
            return
        now = time.time() if now is None else now
        day = self._k("tok", key_hash, int(now // DAY_S))
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.incrby(day, n)
            pipe.expire(day, 2 * DAY_S)
            await pipe.execute()

    async def close(self) -> None:
        await self.redis.aclose()


def _duration(s: float) -> str:
    """A wait as OpenAI's `x-ratelimit-reset-*` headers write it: `59s`, `6m0s`, `1h2m3s`."""
    s = max(0, math.ceil(s))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    if h:
        return f"{h}h{m}m{sec}s"
    return f"{m}m{sec}s" if m else f"{sec}s"


def ratelimit_headers(standing: Standing) -> dict[str, str]:
    """OpenAI's `x-ratelimit-*` headers for the limits a key has (none: no headers)."""
    limits, now, out = standing.limits, standing.now, {}
    if limits.requests_per_min is not None:
        out["x-ratelimit-limit-requests"] = str(limits.requests_per_min)
        left = max(0, limits.requests_per_min - standing.requests_this_min)
        out["x-ratelimit-remaining-requests"] = str(left)
        out["x-ratelimit-reset-requests"] = _duration(60 - now % 60)
    if limits.tokens_per_day is not None:
        out["x-ratelimit-limit-tokens"] = str(limits.tokens_per_day)
        left = max(0, limits.tokens_per_day - standing.tokens_today)
        out["x-ratelimit-remaining-tokens"] = str(left)
        out["x-ratelimit-reset-tokens"] = _duration(DAY_S - now % DAY_S)
    return out


class QuotaMiddleware:
    """Admits agent calls of valid keys against `app.state.quotas` (absent: quotas off),
    adds the `x-ratelimit-*` headers, and counts the tokens the call stored."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        quotas: QuotaService | None = (
            getattr(scope["app"].state, "quotas", None) if "app" in scope else None
        )
        path = scope.get("path", "")
        if scope["type"] != "http" or quotas is None or not path.startswith(AGENT_PREFIXES):
            await self.app(scope, receive, send)
            return
        ident = identity_of(scope)
        try:
            await authenticated_run(scope["app"].state, scope)
        except APIError:  # no key, not a run's, the database away: the route answers
            await self.app(scope, receive, send)
            return
        key_hash = ident.required_hash()  # there is one: the run was found by it
        try:
            standing = await quotas.admit(key_hash)
        except OverQuota as exc:
            response = error_response(exc.error, path)
            response.headers.update(ratelimit_headers(exc.standing))
            await response(scope, receive, send)
            return
        except RedisError as exc:
            logger.warning("quota check of %s skipped, Redis unavailable: %s", ident.label, exc)
            await self.app(scope, receive, send)
            return
        headers = [(k.encode(), v.encode()) for k, v in ratelimit_headers(standing).items()]

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start" and headers:
                message["headers"] = [*message.get("headers", ()), *headers]
            await send(message)

        usage = StoredTokens()
        token = stored_tokens.set(usage)
        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            stored_tokens.reset(token)
            try:
                await quotas.add_tokens(key_hash, usage.tokens)
            except RedisError as exc:
                logger.warning("token count of %s lost, Redis unavailable: %s", ident.label, exc)
