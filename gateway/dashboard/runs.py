"""Dashboard pages for runs: the list, one run with its episodes, an episode, the JSON feeds.

`actions` holds `POST /runs/{run_id}/{action}` on its own router because it
must be installed after every other `/runs/{run_id}/...` POST (its `{action}`
would capture them).
"""

from __future__ import annotations

import contextlib
import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gateway.agent.policies import declared_policies
from gateway.dashboard.analysis import RUN_CHARTS, episode_filters
from gateway.dashboard.auth import session_post
from gateway.dashboard.pages import PREFIX, SECURITY_HEADERS, PagesDep, error_message, redirect
from gateway.dashboard.summary import runs_summary
from gateway.deps import AgentBaseUrlDep, FeedSessionDep, PageSessionDep
from gateway.errors import APIError, NotFound
from gateway.protocol import RunCreate
from gateway.protocol_admin import EpisodeQuery

router = APIRouter(include_in_schema=False)
actions = APIRouter(include_in_schema=False)
RUN_ACTIONS = ("pause", "resume", "stop")
# What the run page's poll needs of the run (the rest of it does not change while it is open).
_LIVE_RUN_FIELDS = ("name", "status", "current_version", "served_version", "created_at")


@router.get("/", dependencies=[PageSessionDep])
async def runs_page(request: Request, base_url: AgentBaseUrlDep, pages: PagesDep) -> Response:
    return pages.render(request, "runs.html", runs=await runs_summary(request, base_url))


@router.post("/runs")
async def create_run(request: Request, base_url: AgentBaseUrlDep, pages: PagesDep) -> Response:
    _, form = await session_post(request)
    try:
        config = json.loads(form.get("config") or "{}")
        body = RunCreate(name=form.get("name", ""), model=form.get("model", ""), config=config)
        created = await request.app.state.runs.create(body, base_url)
    except (ValueError, APIError) as exc:
        return redirect(f"{PREFIX}/", error_message(exc))
    return pages.render(request, "created.html", run=created.model_dump())


@router.get("/runs/{run_id}", dependencies=[PageSessionDep])
async def run_page(
    run_id: str, request: Request, base_url: AgentBaseUrlDep, pages: PagesDep
) -> Response:
    st = request.app.state
    run = await st.runs.public(await st.runs.get(run_id), base_url)
    try:
        filters, parsed = episode_filters(request.query_params)
        episodes = await st.episode_admin.list(run_id, EpisodeQuery(**parsed, limit=100))
    except (ValueError, APIError) as exc:
        return redirect(f"{PREFIX}/runs/{run_id}", error_message(exc))
    versions = [v.model_dump() for v in await st.run_admin.versions(run_id)]
    children = await st.policies.of(run_id) if run.config.get("policies") else {}
    policies = [(await st.runs.public(c, base_url)).model_dump() for c in children.values()]
    return pages.render(
        request,
        "run.html",
        run=run.model_dump(),
        policies=policies,
        versions=versions,
        sink_errors=sum(int(v["metrics"].get("sink_errors", 0)) for v in versions),
        counters=(await st.metrics_admin.counters(run_id)).model_dump(),
        episodes=episodes.model_dump()["data"],
        has_more=episodes.has_more,
        filters=filters,
        run_charts=RUN_CHARTS,
    )


@router.get("/runs/{run_id}/episodes/{episode_id}", dependencies=[PageSessionDep])
async def episode_page(run_id: str, episode_id: str, request: Request, pages: PagesDep) -> Response:
    """One episode, token by token. A run with policies (docs/policies.md) shows the
    episode's turns of every policy in the order they were made, each marked by policy."""
    st = request.app.state
    run = await st.runs.get(run_id)
    children = await st.policies.of(run_id) if declared_policies(run) else {}
    if not children:
        detail = await st.episode_admin.detail(run_id, episode_id)
        return pages.render(request, "episode.html", run_id=run_id, episode=detail.model_dump())
    parts = []
    for name, child in children.items():
        with contextlib.suppress(NotFound):  # a policy that took no turn of it
            parts.append((name, (await st.episode_admin.detail(child.id, episode_id)).model_dump()))
    if not parts:
        raise NotFound(f"no episode {episode_id!r} in run {run_id!r}", param="episode_id")
    turns = sorted(
        ({**c, "policy": name} for name, part in parts for c in part["completions"]),
        key=lambda c: c["created_at"],
    )
    episode = parts[0][1] | {
        "completions": turns,
        "status": ", ".join(f"{name}: {part['status']}" for name, part in parts),
        "versions": sorted({v for _, part in parts for v in part["versions"]}),
    }
    return pages.render(
        request, "episode.html", run_id=run_id, episode=episode, policies=list(children)
    )


@router.get("/api/runs", dependencies=[FeedSessionDep])
async def runs_feed(request: Request, base_url: AgentBaseUrlDep) -> JSONResponse:
    runs = await runs_summary(request, base_url)
    return JSONResponse({"runs": runs}, headers=SECURITY_HEADERS)


@router.get("/api/runs/{run_id}/live", dependencies=[FeedSessionDep])
async def run_feed(run_id: str, request: Request, base_url: AgentBaseUrlDep) -> JSONResponse:
    """What the run page polls: status, versions, metric series, counters, held-out figures."""
    st = request.app.state
    run = (await st.runs.public(await st.runs.get(run_id), base_url)).model_dump()
    series = await st.metrics_admin.series(run_id)
    versions = await st.run_admin.versions(run_id)
    counters = await st.metrics_admin.counters(run_id)
    return JSONResponse(
        {
            "run": {k: run[k] for k in _LIVE_RUN_FIELDS},
            "metrics": series.model_dump(),
            "versions": [v.model_dump() for v in versions],
            "counters": counters.model_dump(),
            # the held-out chart: what GET /admin/v1/runs/{id}/evals answers
            "evals": (await st.eval_admin.figures(run_id)).model_dump(),
        },
        headers=SECURITY_HEADERS,
    )


@actions.post("/runs/{run_id}/{action}")
async def run_action(run_id: str, action: str, request: Request) -> Response:
    await session_post(request)
    if action not in RUN_ACTIONS:
        return redirect(f"{PREFIX}/runs/{run_id}", f"no action {action!r}")
    try:
        await request.app.state.runs.set_status(run_id, action)
    except APIError as exc:
        return redirect(f"{PREFIX}/runs/{run_id}", exc.message)
    return redirect(f"{PREFIX}/runs/{run_id}")
