"""Prometheus metrics: counters kept as events happen, request middleware, `/metrics` itself.

A scrape costs the same whatever the store holds: it runs no SQL. Request
counts and latencies are recorded by `PrometheusMiddleware` labelled by route
template (not the raw path, so label cardinality stays bounded) and status;
completions and their prompt and sampled tokens are counted when the capture
writer commits them (`CaptureWriter.on_commit`), so a counter never runs ahead
of the store.

Several gateway processes on one port (`rlgate up --workers N`): a scrape
reaches one of them, so the event counters use prometheus_client's
multiprocess mode, which `rlgate.serve` turns on by setting
`PROMETHEUS_MULTIPROC_DIR` (a fresh folder under the data dir) before the
processes start. Each process then writes its counters to a memory-mapped
file of its own and a scrape sums the files: the cost is one small file per
process, the counts are exact, and no write is added to the agent's path
(keeping them in the store would add one contended row update per call). A
process that dies keeps its file, so counters never go backwards. The
per-process gauges (the leader, overload, served versions) stay per process,
labelled by what they describe.

`/metrics` needs the admin key unless `metrics_public`; then a caller without
it gets no run id: run-labelled counters summed over runs, run-labelled gauges
left out.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.store.models import Completion
from gateway.deps import require_admin
from gateway.errors import AuthenticationFailed

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# prometheus_client's own switch (read when it is imported), set by `rlgate.serve`
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_dir() -> Path | None:
    """The folder the processes of `rlgate up --workers N` share their counters through."""
    value = os.environ.get(MULTIPROC_ENV)
    return Path(value) if value else None


class ServedVersions(Collector):
    """`rlgate_served_version{run_id}`: the policy version this process serves, per run."""

    def __init__(self) -> None:
        self.served: dict[str, Any] = {}  # run id -> RunServing, set by the scrape

    def collect(self) -> Iterator[Metric]:
        fam = GaugeMetricFamily(
            "rlgate_served_version", "policy version this gateway process serves", labels=["run_id"]
        )
        for run_id, serving in sorted(self.served.items()):
            fam.add_metric([run_id], int(serving.backend.version))
        yield fam


class GatewayMetrics:
    """The app's own registry (never the process-global one) and its instruments."""

    def __init__(self, shared_dir: Path | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # Multiprocess mode: the instruments' values live in files that the scrape sums, so
        # they are kept out of the rendered registry (else this process's share twice).
        instruments = CollectorRegistry() if shared_dir else self.registry
        if shared_dir:
            MultiProcessCollector(self.registry, path=str(shared_dir))
        self.requests = Counter(
            "rlgate_http_requests",
            "HTTP requests by route template, method and status",
            ["route", "method", "status"],
            registry=instruments,
        )
        self.latency = Histogram(
            "rlgate_http_request_duration_seconds",
            "time to the end of the response body",
            ["route", "method"],
            buckets=LATENCY_BUCKETS,
            registry=instruments,
        )
        self.completions = Counter(
            "rlgate_completions", "completions captured", ["run_id"], registry=instruments
        )
        self.prompt_tokens = Counter(
            "rlgate_prompt_tokens",
            "prompt tokens of the captured completions",
            ["run_id"],
            registry=instruments,
        )
        self.output_tokens = Counter(
            "rlgate_output_tokens",
            "sampled tokens of the captured completions",
            ["run_id"],
            registry=instruments,
        )
        self.served = ServedVersions()
        self.registry.register(self.served)

    def committed(self, rows: Iterable[Completion]) -> None:
        """Count completions the capture writer has just committed."""
        for row in rows:
            self.completions.labels(row.run_id).inc()
            self.prompt_tokens.labels(row.run_id).inc(len(row.prompt_token_ids))
            self.output_tokens.labels(row.run_id).inc(len(row.output_token_ids))

    def render(self, served: dict[str, Any], with_runs: bool = True) -> bytes:
        """The text format; `with_runs=False`: no sample names a run (see the docstring)."""
        self.served.served = served
        return generate_latest(self.registry if with_runs else _WithoutRuns(self.registry))


class _WithoutRuns:
    """A registry's families with nothing that names a run: `run_id`-labelled counters
    summed over runs, `run_id`-labelled gauges dropped, and of the overload guard's
    scopes (`backend:<run id>`, a LoRA base's model path) only the process's kept."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for fam in self.registry.collect():
            samples = [s for s in fam.samples if s.labels.get("scope", "process") == "process"]
            if not any("run_id" in s.labels for s in samples):
                out = Metric(fam.name, fam.documentation, fam.type)
                out.samples = samples
                yield out
                continue
            if fam.type != "counter":
                continue
            sums: dict[tuple, float] = {}
            for s in samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "run_id"))
                sums[(s.name, labels)] = sums.get((s.name, labels), 0.0) + s.value
            out = Metric(fam.name, fam.documentation, fam.type)
            for (name, labels), value in sorted(sums.items()):
                out.add_sample(name, dict(labels), value)
            yield out


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
    """Prometheus text format: the admin key, or anyone when `metrics_public` (no run ids)."""
    state = request.app.state
    try:
        await require_admin(request)
        admin = True
    except AuthenticationFailed:
        if not state.settings.metrics_public:
            raise
        admin = False
    body = state.metrics.render(state.pool.loaded(), with_runs=admin)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
