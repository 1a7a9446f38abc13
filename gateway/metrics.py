"""Prometheus metrics: a registry per app, request middleware, and store-derived families.

Request counts and latencies are recorded by `PrometheusMiddleware` labelled
by route template (not the raw path, so label cardinality stays bounded) and
status. Token totals, queue depth, served versions and episodes by status are
read from the store when `/metrics` is scraped: they are then exact for every
gateway process sharing the store, streaming answers included.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.store.completions import token_totals
from gateway.store.episodes import episode_counts
from gateway.store.runs import current_versions
from gateway.store.steps import pending_steps_by_run

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


@dataclass
class StoreSnapshot:
    """What the store said at the last scrape, per run."""

    prompt_tokens: dict[str, int] = field(default_factory=dict)
    output_tokens: dict[str, int] = field(default_factory=dict)
    pending_steps: dict[str, int] = field(default_factory=dict)
    current_version: dict[str, int] = field(default_factory=dict)
    served_version: dict[str, int] = field(default_factory=dict)
    episodes: dict[tuple[str, str], int] = field(default_factory=dict)


class StoreCollector(Collector):
    def __init__(self) -> None:
        self.snapshot = StoreSnapshot()

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot
        families = [
            (CounterMetricFamily, "rlgate_prompt_tokens", "prompt tokens sent to the backend"),
            (CounterMetricFamily, "rlgate_output_tokens", "tokens sampled by the backend"),
            (GaugeMetricFamily, "rlgate_pending_train_steps", "train steps queued or running"),
            (GaugeMetricFamily, "rlgate_current_version", "newest policy version of the run"),
            (GaugeMetricFamily, "rlgate_served_version", "policy version this gateway serves"),
        ]
        values = [
            snap.prompt_tokens,
            snap.output_tokens,
            snap.pending_steps,
            snap.current_version,
            snap.served_version,
        ]
        for (kind, name, doc), by_run in zip(families, values, strict=True):
            fam = kind(name, doc, labels=["run_id"])
            for run_id, value in sorted(by_run.items()):
                fam.add_metric([run_id], value)
            yield fam
        eps = GaugeMetricFamily(
            "rlgate_episodes", "episodes by status", labels=["run_id", "status"]
        )
        for (run_id, status), n in sorted(snap.episodes.items()):
            eps.add_metric([run_id, status], n)
        yield eps


class GatewayMetrics:
    """The app's own registry (never the process-global one) and its instruments."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "rlgate_http_requests",
            "HTTP requests by route template, method and status",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "rlgate_http_request_duration_seconds",
            "time to the end of the response body",
            ["route", "method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.store = StoreCollector()
        self.registry.register(self.store)

    async def refresh(self, sessions: async_sessionmaker[AsyncSession], served: dict) -> None:
        async with sessions() as s:
            tokens = await token_totals(s)
            pending = await pending_steps_by_run(s)
            versions = await current_versions(s)
            episodes = await episode_counts(s)
        self.store.snapshot = StoreSnapshot(
            prompt_tokens={r: p for r, (p, _) in tokens.items()},
            output_tokens={r: o for r, (_, o) in tokens.items()},
            pending_steps=pending,
            current_version=versions,
            served_version={r: int(serving.backend.version) for r, serving in served.items()},
            episodes=episodes,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class PrometheusMiddleware:
    """Counts every HTTP request and times it to the last body byte (streams included)."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics
        # (route, method, status) -> its counter and histogram: `labels()` takes a lock and
        # builds the label tuple on every call; the set of routes and statuses is small
        self._children: dict[tuple[str, str, int], tuple[Any, Any]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def observe(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, observe)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            key = (template, scope.get("method", ""), status)
            children = self._children.get(key)
            if children is None:
                children = self._children[key] = (
                    self.metrics.requests.labels(key[0], key[1], str(status)),
                    self.metrics.latency.labels(key[0], key[1]),
                )
            children[0].inc()
            children[1].observe(time.perf_counter() - start)


router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    """Prometheus text format. Unauthenticated, like most exporters: bind or firewall it."""
    state = request.app.state
    await state.metrics.refresh(state.sessions, state.pool.loaded())
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
