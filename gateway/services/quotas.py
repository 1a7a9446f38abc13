"""Per-key rate limits (requests per minute) and token quotas (tokens per UTC day) in Redis.

Off unless `quota_redis_url` is set. A key's limits are its own (set through
the admin API, stored in Redis next to its counters) or else the settings'
defaults. Keys are identified by the SHA-256 of the agent key, as in the
store, so the check needs no database round trip.

Requests: a fixed one-minute window per key (`INCR` + `EXPIRE`); the call that
goes over gets 429 with `Retry-After` = seconds to the next window. Tokens: a
per-day counter of prompt + completion tokens, added after each answer from
its `usage` (streams: from the `include_usage` chunk, else one token per
content chunk, as the gateway streams token by token); once the day's count
reaches the quota, calls get 429 until the next UTC midnight. A call that
starts under the quota finishes, so a day may end slightly over it.

If Redis cannot be reached the gateway serves anyway (fails open) and logs it:
a quota outage must not take the API down.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import RateLimited, error_response
from gateway.keys import hash_key

logger = logging.getLogger(__name__)

DAY_S = 86400
# Agent endpoints: /v1/..., /episodes/{id}/v1/..., /groups/{g}/episodes/{id}/v1/...
AGENT_PREFIXES = ("/v1/", "/episodes/", "/groups/")


@dataclass(frozen=True)
class Limits:
    requests_per_min: int | None = None
    tokens_per_day: int | None = None


@dataclass(frozen=True)
class Usage:
    requests_this_min: int
    tokens_today: int


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

    async def limits(self, key_hash: str) -> Limits:
        raw = await self.redis.get(self._k("limits", key_hash))
        if raw is None:
            return self.defaults
        data = json.loads(raw)
        return Limits(data.get("requests_per_min"), data.get("tokens_per_day"))

    async def usage(self, key_hash: str, now: float | None = None) -> Usage:
        now = time.time() if now is None else now
        req, tok = await self.redis.mget(
            self._k("req", key_hash, int(now // 60)), self._k("tok", key_hash, int(now // DAY_S))
        )
        return Usage(int(req or 0), int(tok or 0))

    async def admit(self, key_hash: str, now: float | None = None) -> None:
        """Count one request; raise RateLimited if the key is over either limit."""
        now = time.time() if now is None else now
        limits = await self.limits(key_hash)
        if limits.tokens_per_day is not None:
            used = int(await self.redis.get(self._k("tok", key_hash, int(now // DAY_S))) or 0)
            if used >= limits.tokens_per_day:
                raise RateLimited(
                    f"token quota of {limits.tokens_per_day} per day used up",
                    retry_after_s=max(1, int(DAY_S - now % DAY_S)),
                    code="quota_exceeded",
                )
        if limits.requests_per_min is not None:
            window = self._k("req", key_hash, int(now // 60))
            async with self.redis.pipeline(transaction=True) as pipe:
                count, _ = await pipe.incr(window).expire(window, 120).execute()
            if count > limits.requests_per_min:
                raise RateLimited(
                    f"rate limit of {limits.requests_per_min} requests per minute reached",
                    retry_after_s=max(1, int(60 - now % 60)),
                    code="rate_limit_exceeded",
                )

    async def add_tokens(self, key_hash: str, n: int, now: float | None = None) -> None:
        if n <= 0:
            return
        now = time.time() if now is None else now
        day = self._k("tok", key_hash, int(now // DAY_S))
        async with self.redis.pipeline(transaction=True) as pipe:
            await pipe.incrby(day, n).expire(day, 2 * DAY_S).execute()

    async def close(self) -> None:
        await self.redis.aclose()


class _TokenCounter:
    """Reads `usage` from a JSON answer or an SSE stream as its body goes out."""

    def __init__(self, streaming: bool) -> None:
        self.streaming = streaming
        self.body = bytearray()
        self.tokens = 0
        self.chunks = 0
        self.usage_seen = False

    def feed(self, data: bytes) -> None:
        if not self.streaming:
            if len(self.body) < 1 << 22:
                self.body += data
            return
        self.body += data
        *events, rest = bytes(self.body).split(b"\n\n")
        self.body = bytearray(rest)
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
                    self._event(line[6:])

    def _event(self, raw: bytes) -> None:
        try:
            obj = json.loads(raw)
        except ValueError:
            return
        if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
            self.tokens = _total(obj["usage"])
            self.usage_seen = True
        elif isinstance(obj, dict) and obj.get("choices"):
            self.chunks += 1

    def total(self) -> int:
        if self.streaming:
            return self.tokens if self.usage_seen else self.chunks
        try:
            usage = json.loads(bytes(self.body)).get("usage")
        except (ValueError, AttributeError):
            return 0
        return _total(usage) if isinstance(usage, dict) else 0


def _total(usage: dict) -> int:
    if isinstance(usage.get("total_tokens"), int):
        return usage["total_tokens"]
    parts = ("prompt_tokens", "completion_tokens", "input_tokens", "output_tokens")
    return sum(int(usage.get(k) or 0) for k in parts)


class QuotaMiddleware:
    """Admits agent calls against `app.state.quotas` (absent: quotas off) and counts tokens."""

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
        auth = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            await self.app(scope, receive, send)  # the route answers 401
            return
        key_hash = hash_key(token.strip())
        try:
            await quotas.admit(key_hash)
        except RateLimited as exc:
            await error_response(exc, scope["path"])(scope, receive, send)
            return
        except RedisError as exc:
            logger.warning("quota check skipped, Redis unavailable: %s", exc)
            await self.app(scope, receive, send)
            return
        counter: _TokenCounter | None = None

        async def counting_send(message: Message) -> None:
            nonlocal counter
            if message["type"] == "http.response.start" and message["status"] == 200:
                ctype = dict(message.get("headers") or []).get(b"content-type", b"")
                counter = _TokenCounter(streaming=ctype.startswith(b"text/event-stream"))
            elif message["type"] == "http.response.body" and counter is not None:
                counter.feed(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            if counter is not None:
                try:
                    await quotas.add_tokens(key_hash, counter.total())
                except RedisError as exc:
                    logger.warning("token count lost, Redis unavailable: %s", exc)
