"""Agent routes come first in the route table, which is safe only while no other path can match
one of them (or be matched by one): each side starts with literal segments of its own."""

from __future__ import annotations

from gateway.app import ADMIN_ROUTERS, AGENT_ROUTERS, EPISODE_PREFIXES
from gateway.dashboard.routes import PREFIX as DASHBOARD
from gateway.metrics import router as prometheus_router
from gateway.routes import health

_FORMS = ("/v1/", "/episodes/{episode_id}/v1/", "/groups/{group_id}/episodes/{episode_id}/v1/")
AGENT_STARTS = (*_FORMS, *("/eval" + form for form in _FORMS))
# the first segment of every agent path: anything else can never match an agent route
AGENT_FIRST = ("v1", "episodes", "groups", "eval")


def _paths(router) -> list[str]:
    return [route.path for route in router.routes]


def test_agent_routes_and_every_other_route_cannot_match_each_other() -> None:
    agent = [
        prefix + p for prefix in EPISODE_PREFIXES for r in AGENT_ROUTERS for p in _paths(r.router)
    ]
    assert len(agent) > 20
    for path in agent:
        assert path.startswith(AGENT_STARTS), path
    others = [p for r in ADMIN_ROUTERS for p in _paths(r.router)]
    others += _paths(health.router) + _paths(prometheus_router) + [DASHBOARD + "/"]
    assert len(others) > 20
    for path in others:
        first = path.strip("/").split("/")[0]
        assert first not in AGENT_FIRST and not first.startswith("{"), path


def test_agent_routes_run_no_dependency_in_a_worker_thread() -> None:
    # FastAPI runs a plain `def` dependency (or endpoint) in a thread pool: a thread hop and
    # a GIL hand-off on every agent call, for functions that never block.
    import inspect

    def sync_calls(dependant) -> list[str]:
        found = (
            []
            if dependant.call is None or inspect.iscoroutinefunction(dependant.call)
            else [dependant.call.__qualname__]
        )
        for sub in dependant.dependencies:
            found += sync_calls(sub)
        return found

    for agent in AGENT_ROUTERS:
        for route in agent.router.routes:
            assert sync_calls(route.dependant) == [], route.path
