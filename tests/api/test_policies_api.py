"""Policies of a run through a real gateway (uvicorn, SQLite, the tiny model), called with
the real `openai` and `anthropic` clients: naming, routing, one episode across policies,
policy-scoped and episode rewards. Training per policy is in
tests/integration/test_policies.py."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import anthropic
import httpx
import openai
import pytest

from trainer.config import RunConfig

if TYPE_CHECKING:
    from tests.conftest import GatewayServer

pytestmark = pytest.mark.integration

POLICIES = {"lora_rank": 4, "policies": {"planner": {}, "coder": {"lora_rank": 8}}}


@pytest.fixture(scope="module")
def team(gateway_server: GatewayServer) -> dict:
    return gateway_server.create_run("team", POLICIES)


def _agent(gateway_server: GatewayServer, run: dict, path: str = "") -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{gateway_server.url}{path}/v1", api_key=run["api_key"], max_retries=0
    )


def _policy_of(gateway_server: GatewayServer, completion_id: str) -> str | None:
    ((policy,),) = gateway_server.query(
        "SELECT runs.policy FROM completions JOIN runs ON runs.id = completions.run_id"
        " WHERE completions.id = ?",
        (completion_id,),
    )
    return policy


def _ask(agent: openai.OpenAI, model: str, messages: list[dict]) -> openai.types.ChatCompletion:
    return agent.chat.completions.create(
        model=model, messages=messages, max_tokens=6, temperature=1.0, seed=1
    )


def test_policy_config_inherits_the_run_and_refuses_what_cannot_train() -> None:
    cfg = RunConfig.model_validate(POLICIES | {"learning_rate": 1e-4})
    coder = cfg.policy_config("coder")
    assert (coder.lora_rank, coder.learning_rate, coder.policies) == (8, 1e-4, None)
    assert cfg.policy_config("planner").lora_rank == 4
    with pytest.raises(ValueError, match="has no lora_rank"):
        RunConfig.model_validate({"policies": {"planner": {}}})
    with pytest.raises(ValueError, match="not a policy name"):
        RunConfig.model_validate({"lora_rank": 4, "policies": {"Planner": {}}})


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"policies": {"planner": {}}}, "has no lora_rank"),
        ({"lora_rank": 4, "policies": {"a/b": {}}}, "not a policy name"),
        ({"lora_rank": 4, "policies": {}}, "1 to 64"),
        ({"lora_rank": 4, "policies": {"a": {"lora_rank": 0}}}, "greater than or equal to 1"),
    ],
)
def test_a_bad_policy_declaration_is_a_400_naming_policies(
    gateway_server: GatewayServer, config: dict, message: str
) -> None:
    resp = httpx.post(
        gateway_server.url + "/admin/v1/runs",
        json={"name": "bad", "model": "tiny", "config": config},
        headers=gateway_server.admin_headers(),
        timeout=60,
    )
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"].startswith("config.policies") and message in error["message"], error
    assert gateway_server.query("SELECT COUNT(*) FROM runs WHERE name LIKE 'bad%'") == [(0,)]


def test_each_policy_is_a_run_under_its_parent_listed_as_a_model(
    gateway_server: GatewayServer, team: dict
) -> None:
    rows = gateway_server.query(
        "SELECT name, policy, config FROM runs WHERE parent_id = ? ORDER BY created_at, id",
        (team["run_id"],),
    )
    assert [(name, policy) for name, policy, _ in rows] == [
        ("team/planner", "planner"),
        ("team/coder", "coder"),
    ]
    models = [m.id for m in _agent(gateway_server, team).models.list()]
    assert models == ["team/planner", "team/coder"]
    with httpx.Client(base_url=gateway_server.url, headers=gateway_server.admin_headers()) as c:
        listed = {r["name"]: r for r in c.get("/admin/v1/runs").json()}
    assert listed["team/coder"]["parent_id"] == team["run_id"]
    assert listed["team/coder"]["config"]["lora_rank"] == 8
    assert listed["team"]["policy"] is None


@pytest.mark.parametrize(
    ("model", "policy"),
    [
        ("team/coder", "coder"),
        ("team/planner", "planner"),
        ("team", "planner"),  # the bare run name: the first declared policy
        ("openai/coder", "coder"),  # the part after the last "/" names the policy
    ],
)
def test_model_picks_the_policy_that_serves_and_stores_the_call(
    gateway_server: GatewayServer, team: dict, model: str, policy: str
) -> None:
    resp = _ask(_agent(gateway_server, team), model, [{"role": "user", "content": "hi"}])
    assert _policy_of(gateway_server, resp.id) == policy


def test_an_unknown_policy_is_openais_model_not_found(
    gateway_server: GatewayServer, team: dict
) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        _ask(_agent(gateway_server, team), "team/reviewer", [{"role": "user", "content": "hi"}])
    body = err.value.body
    assert body["code"] == "model_not_found" and body["param"] == "model", body
    assert "team/planner" in body["message"] and "team/coder" in body["message"]


def test_anthropic_messages_pick_a_policy_too(gateway_server: GatewayServer, team: dict) -> None:
    client = anthropic.Anthropic(
        base_url=gateway_server.url, api_key=team["api_key"], max_retries=0
    )
    msg = client.messages.create(
        model="team/coder", max_tokens=6, messages=[{"role": "user", "content": "hi"}]
    )
    assert _policy_of(gateway_server, msg.id) == "coder"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(
            model="team/nobody", max_tokens=6, messages=[{"role": "user", "content": "hi"}]
        )


def _episode_of_two_policies(gateway_server: GatewayServer, team: dict, episode: str):
    """The planner answers, then the coder continues the same conversation (one episode)."""
    agent = _agent(gateway_server, team, f"/groups/g-{episode}/episodes/{episode}")
    question = [{"role": "user", "content": "Plan a number."}]
    plan = _ask(agent, "team/planner", question)
    history = [
        *question,
        {"role": "assistant", "content": plan.choices[0].message.content},
        {"role": "user", "content": "Now write it."},
    ]
    code = _ask(agent, "team/coder", history)
    return plan, code


def test_one_episode_across_policies_is_spliced_token_exact(
    gateway_server: GatewayServer, team: dict
) -> None:
    plan, code = _episode_of_two_policies(gateway_server, team, "splice-1")
    planned = gateway_server.completion(plan.id)
    coded = gateway_server.completion(code.id)
    assert coded["parent_id"] == plan.id and coded["spliced"], coded
    head = planned["prompt_token_ids"] + planned["output_token_ids"]
    assert coded["prompt_token_ids"][: len(head)] == head  # the planner's sampled ids, as sampled
    groups = gateway_server.query(
        "SELECT runs.policy, episodes.group_id FROM episodes JOIN runs ON runs.id = episodes.run_id"
        " WHERE episodes.id = 'splice-1' ORDER BY runs.policy"
    )
    assert groups == [("coder", "g-splice-1"), ("planner", "g-splice-1")]
    # prefix matching links the coder's turn without any id, across policies too
    agent = _agent(gateway_server, team)
    question = [{"role": "user", "content": "Plan another number."}]
    first = _ask(agent, "team/planner", question)
    history = [*question, {"role": "assistant", "content": first.choices[0].message.content}]
    second = _ask(agent, "team/coder", [*history, {"role": "user", "content": "Go."}])
    linked = gateway_server.completion(second.id)
    assert linked["parent_id"] == first.id and linked["link"] == "prefix"
    assert second.model_extra["episode_id"] == first.model_extra["episode_id"]


def _statuses(gateway_server: GatewayServer, episode: str) -> dict[str, str]:
    rows = gateway_server.query(
        "SELECT runs.policy, episodes.status FROM episodes JOIN runs ON runs.id = episodes.run_id"
        " WHERE episodes.id = ?",
        (episode,),
    )
    return dict(rows)


def _reward(gateway_server: GatewayServer, team: dict, body: dict) -> httpx.Response:
    return httpx.post(
        gateway_server.url + "/v1/rewards",
        json=body,
        headers={"Authorization": f"Bearer {team['api_key']}"},
        timeout=30,
    )


def test_a_policy_scoped_reward_reaches_that_policy_only(
    gateway_server: GatewayServer, team: dict
) -> None:
    _episode_of_two_policies(gateway_server, team, "scoped-1")
    body = {"episode_id": "scoped-1", "policy": "coder", "reward": 1.0, "idempotency_key": "s1"}
    resp = _reward(gateway_server, team, body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["run_id"] == team["run_id"]
    assert _statuses(gateway_server, "scoped-1") == {"coder": "rewarded", "planner": "open"}
    again = _reward(gateway_server, team, body)
    assert again.json()["duplicate"] is True
    other = _reward(gateway_server, team, body | {"policy": "planner"})
    assert other.status_code == 409  # the key was used for another policy
    assert _statuses(gateway_server, "scoped-1") == {"coder": "rewarded", "planner": "open"}
    assert gateway_server.query("SELECT policy FROM rewards WHERE idempotency_key = 's1'") == [
        ("coder",)
    ]


def test_an_episode_reward_reaches_every_policy_of_the_episode(
    gateway_server: GatewayServer, team: dict
) -> None:
    _episode_of_two_policies(gateway_server, team, "whole-1")
    resp = _reward(gateway_server, team, {"episode_id": "whole-1", "reward": 0.5})
    assert resp.status_code == 200, resp.text
    assert _statuses(gateway_server, "whole-1") == {"coder": "rewarded", "planner": "rewarded"}


def test_a_completion_reward_reaches_its_own_policy(
    gateway_server: GatewayServer, team: dict
) -> None:
    plan, _ = _episode_of_two_policies(gateway_server, team, "turn-1")
    resp = _reward(gateway_server, team, {"completion_id": plan.id, "reward": 1.0})
    assert resp.status_code == 200, resp.text
    ((reward,),) = gateway_server.query("SELECT reward FROM completions WHERE id = ?", (plan.id,))
    assert reward == 1.0
    assert _statuses(gateway_server, "turn-1") == {"coder": "open", "planner": "rewarded"}


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"episode_id": "scoped-1", "policy": "reviewer", "reward": 1.0}, 404, "policy"),
        ({"episode_id": "no-such", "policy": "coder", "reward": 1.0}, 404, "episode_id"),
        ({"completion_id": "chatcmpl-x", "policy": "coder", "reward": 1.0}, 400, None),
        ({"episode_id": "scoped-1", "policy": "Coder!", "reward": 1.0}, 400, None),
    ],
)
def test_bad_policy_rewards_are_4xx_and_store_nothing(
    gateway_server: GatewayServer, team: dict, body: dict, status: int, param: str | None
) -> None:
    before = gateway_server.count("rewards")
    resp = _reward(gateway_server, team, body)
    assert resp.status_code == status, resp.text
    if param is not None:
        assert resp.json()["error"]["param"] == param
    assert gateway_server.count("rewards") == before


def test_a_run_without_policies_refuses_a_policy_reward(
    gateway_server: GatewayServer, create_run
) -> None:
    solo = create_run()
    resp = _reward(gateway_server, solo, {"episode_id": "x", "policy": "coder", "reward": 1.0})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "policy", resp.text
    models = [m.id for m in _agent(gateway_server, solo).models.list()]
    assert models == [solo["name"]]


def test_pausing_the_run_pauses_its_policies_and_deleting_it_deletes_them(
    gateway_server: GatewayServer,
) -> None:
    run = gateway_server.create_run("short-lived", POLICIES)
    agent = _agent(gateway_server, run)
    with httpx.Client(base_url=gateway_server.url, headers=gateway_server.admin_headers()) as c:
        assert c.post(f"/admin/v1/runs/{run['run_id']}/pause").status_code == 200
        with pytest.raises(openai.RateLimitError):
            _ask(agent, "short-lived/coder", [{"role": "user", "content": "hi"}])
        assert c.post(f"/admin/v1/runs/{run['run_id']}/resume").status_code == 200
        _ask(agent, "short-lived/coder", [{"role": "user", "content": "hi"}])
        assert c.post(f"/admin/v1/runs/{run['run_id']}/stop").status_code == 200
        assert c.delete(f"/admin/v1/runs/{run['run_id']}").status_code == 200
    assert gateway_server.query(
        "SELECT COUNT(*) FROM runs WHERE id = ? OR parent_id = ?", (run["run_id"], run["run_id"])
    ) == [(0,)]


def test_the_export_of_a_run_with_policies_names_each_records_policy(
    gateway_server: GatewayServer, team: dict
) -> None:
    plan, code = _episode_of_two_policies(gateway_server, team, "export-1")
    resp = httpx.get(
        f"{gateway_server.url}/admin/v1/runs/{team['run_id']}/export",
        params={"format": "jsonl"},
        headers=gateway_server.admin_headers(),
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    records = [json.loads(line) for line in resp.text.splitlines()]
    mine = {r["policy"]: r for r in records if r["episode_id"] == "export-1"}
    assert set(mine) == {"planner", "coder"}
    assert [c["completion_id"] for c in mine["planner"]["completions"]] == [plan.id]
    assert [c["completion_id"] for c in mine["coder"]["completions"]] == [code.id]
    assert {c["policy"] for r in records for c in r["completions"]} == {"planner", "coder"}
    assert all(r["policy"] in ("planner", "coder") for r in records)


def test_a_policy_added_to_a_live_run_is_served_from_the_next_call(
    gateway_server: GatewayServer,
) -> None:
    run = gateway_server.create_run("growing", POLICIES)
    agent = _agent(gateway_server, run)
    with pytest.raises(openai.NotFoundError):
        _ask(agent, "growing/reviewer", [{"role": "user", "content": "hi"}])
    with httpx.Client(base_url=gateway_server.url, headers=gateway_server.admin_headers()) as c:
        url = f"/admin/v1/runs/{run['run_id']}/policies"
        added = c.post(url, json={"name": "reviewer", "lora_rank": 2})
        assert added.status_code == 201, added.text
        assert added.json()["name"] == "growing/reviewer"
        assert added.json()["config"]["lora_rank"] == 2
        assert c.post(url, json={"name": "reviewer"}).status_code == 409
        assert c.post(url, json={"name": "Bad Name"}).status_code == 400
        solo = gateway_server.create_run("solo-live")
        refused = c.post(f"/admin/v1/runs/{solo['run_id']}/policies", json={"name": "x"})
        assert refused.status_code == 400, refused.text
        # live knobs and names of the run reach its policies
        patch = {"name": "grown", "config": {"max_staleness": 3}}
        assert c.patch(f"/admin/v1/runs/{run['run_id']}", json=patch).status_code == 200
    resp = _ask(agent, "grown/reviewer", [{"role": "user", "content": "hi"}])
    assert _policy_of(gateway_server, resp.id) == "reviewer"
    assert [m.id for m in agent.models.list()] == ["grown/planner", "grown/coder", "grown/reviewer"]
    rows = gateway_server.query(
        "SELECT name, config FROM runs WHERE parent_id = ? ORDER BY created_at, id",
        (run["run_id"],),
    )
    assert [name for name, _ in rows] == ["grown/planner", "grown/coder", "grown/reviewer"]
    assert all(json.loads(config)["max_staleness"] == 3 for _, config in rows)


def test_a_policy_joining_an_admitted_episode_is_never_held(
    gateway_server: GatewayServer,
) -> None:
    """Admission is once per episode: the coder's run is full (one pending episode of its
    own), yet its first turn in an episode the planner began is served at once."""
    config = POLICIES | {"max_pending_episodes": 1, "admission_wait_s": 0}
    run = gateway_server.create_run("admitted", config)
    hi = [{"role": "user", "content": "hi"}]
    _ask(_agent(gateway_server, run, "/episodes/coder-own"), "admitted/coder", hi)
    with pytest.raises(openai.RateLimitError):  # full: a new conversation of its own waits
        _ask(_agent(gateway_server, run, "/episodes/coder-new"), "admitted/coder", hi)
    shared = _agent(gateway_server, run, "/episodes/begun-by-planner")
    _ask(shared, "admitted/planner", hi)
    joined = _ask(shared, "admitted/coder", [{"role": "user", "content": "fresh context"}])
    assert _policy_of(gateway_server, joined.id) == "coder"
    assert joined.model_extra["episode_id"] == "begun-by-planner"


def test_a_policys_response_is_retrieved_and_continued_by_another_policy(
    gateway_server: GatewayServer, team: dict
) -> None:
    agent = _agent(gateway_server, team)
    first = agent.responses.create(
        model="team/planner", input="Plan a number.", max_output_tokens=6
    )
    assert agent.responses.retrieve(first.id).id == first.id
    second = agent.responses.create(
        model="team/coder",
        input="Now write it.",
        previous_response_id=first.id,
        max_output_tokens=6,
    )
    assert _policy_of(gateway_server, second.completion_id) == "coder"
    assert gateway_server.completion(second.completion_id)["parent_id"] == first.completion_id


def test_the_python_client_posts_a_policy_scoped_reward(
    gateway_server: GatewayServer, team: dict
) -> None:
    from agents_sdk import NotFoundError, RLGate

    _episode_of_two_policies(gateway_server, team, "sdk-1")
    with RLGate(team["base_url"], team["api_key"]) as gate:
        ack = gate.episode("sdk-1").reward(1.0, policy="planner")
        assert (ack.policy, ack.episode_status) == ("planner", "rewarded")
        with pytest.raises(NotFoundError):
            gate.episode("sdk-1").reward(1.0, policy="reviewer")
        with pytest.raises(ValueError, match="policy goes with episode_id"):
            gate.reward(1.0, completion_id="chatcmpl-x", policy="planner")
    assert _statuses(gateway_server, "sdk-1") == {"coder": "open", "planner": "rewarded"}
