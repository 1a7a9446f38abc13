"""The schema fuzzer's world: runs holding real resources, the callers that knock on each
operation, and the generated values a case may be pointed at so that it reaches them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from tests.conftest import GatewayServer

WRONG_KEY = "rlg-this-key-was-never-issued-by-the-gateway-000000000"
USER = [{"role": "user", "content": "what is one plus two?"}]


@dataclass
class Tenant:
    """A run and the identifiers of the resources it owns."""

    run: dict[str, Any]
    ids: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return self.run["api_key"]


@dataclass(frozen=True)
class Caller:
    """One identity a request can carry; `headers` is what it sends."""

    name: str
    headers: dict[str, str]


@dataclass
class World:
    """`agent` serves the agent endpoints, `admin` is the run admin calls may change or delete
    (so that they never disturb the agent run, whatever order the tests run in), `other` is
    a stranger's run whose key must open nothing of the others."""

    agent: Tenant
    admin: Tenant
    other: Tenant
    admin_key: str

    def callers(self, path: str) -> list[Caller]:
        """No key, a wrong key, another run's key, this run's key and the admin key."""
        own = self.admin if path.startswith("/admin/") else self.agent
        return [
            Caller("no key", {}),
            Caller("wrong key", _bearer(WRONG_KEY)),
            Caller("another run's key", _bearer(self.other.key)),
            Caller("the run's key", _bearer(own.key)),
            Caller("admin key", _bearer(self.admin_key)),
        ]

    def tenant(self, path: str) -> Tenant:
        return self.admin if path.startswith("/admin/") else self.agent


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _seed(server: GatewayServer, name: str) -> Tenant:
    """A run with one answered chat call and one stored response, so ids point at something."""
    tenant = Tenant(server.create_run(name=name))
    with httpx.Client(base_url=server.url, headers=_bearer(tenant.key), timeout=60) as http:
        chat = http.post(
            "/v1/chat/completions", json={"model": name, "messages": USER, "max_tokens": 4}
        )
        assert chat.status_code == 200, chat.text
        choice = chat.json()["choices"][0]
        resp = http.post(
            "/v1/responses", json={"model": name, "input": "one plus two?", "max_output_tokens": 4}
        )
        assert resp.status_code == 200, resp.text
        keys = http.get(
            f"/admin/v1/runs/{tenant.run['run_id']}/keys", headers=server.admin_headers()
        )
        assert keys.status_code == 200, keys.text
    (group,) = server.query("SELECT group_id FROM episodes WHERE id = ?", (choice["episode_id"],))[
        0
    ]
    tenant.ids = {
        "model": name,
        "run_id": tenant.run["run_id"],
        "key_id": keys.json()[0]["id"],
        "completion_id": choice["completion_id"],
        "episode_id": choice["episode_id"],
        "group_id": group,
        "response_id": resp.json()["id"],
        "version": 0,
    }
    return tenant


def build_world(server: GatewayServer) -> World:
    return World(
        agent=_seed(server, "fuzz"),
        admin=_seed(server, "fuzz-admin"),
        other=_seed(server, "fuzz-other"),
        admin_key=server.admin_key,
    )


def point_at(values: dict[str, Any] | None, tenant: Tenant) -> int:
    """Replace, in place, the generated values whose names are the tenant's identifiers (run,
    key, episode, group, completion, response, model, version) by the real ones: a random id
    only ever finds nothing, and the operation's real work is behind a real one. Returns how
    many were replaced."""
    if not isinstance(values, dict):
        return 0
    names = values.keys() & tenant.ids.keys()
    for name in names:
        values[name] = tenant.ids[name]
    return len(names)
