"""Episodes through a real gateway: trees, splicing on real samples, linking, reopening."""

from __future__ import annotations

import itertools

import httpx
import openai
import pytest

from inference.chat_template import ChatTemplate
from trainer.sequences import Turn, assemble

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def run(gateway_server) -> dict:
    return gateway_server.create_run(name="episodes")


@pytest.fixture(scope="module")
def template(tiny_model_dir) -> ChatTemplate:
    return ChatTemplate(tiny_model_dir)


def _client(run: dict, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=run["base_url"], api_key=run["api_key"], default_headers=headers)


def _turns(gateway_server, ids: list[str]) -> list[Turn]:
    rows = [gateway_server.completion(i) for i in ids]
    return [
        Turn(
            r["id"],
            r["parent_id"],
            r["prompt_token_ids"],
            r["output_token_ids"],
            r["output_logprobs"],
            r["temperature"],
            r["policy_version"],
            bool(r["spliced"]),
            r["prompt_hash"],
            k,
        )
        for k, r in enumerate(rows)
    ]


def test_three_turns_on_real_samples_train_as_the_sampled_ids(gateway_server, run):
    client = _client(run, **{"X-Episode-Id": "ep-three"})
    messages = [{"role": "user", "content": "what is one plus two?"}]
    ids = []
    for k in range(3):
        resp = client.chat.completions.create(
            model=run["name"], messages=messages, max_tokens=8, temperature=1.0, seed=10 + k
        )
        ids.append(resp.id)
        messages += [
            {"role": "assistant", "content": resp.choices[0].message.content},
            {"role": "user", "content": f"and then {k}?"},
        ]
    turns = _turns(gateway_server, ids)
    assert [t.parent_id for t in turns] == [None, ids[0], ids[1]]
    for parent, child in itertools.pairwise(turns):
        # The agent echoed each answer as received: every turn splices, even where the
        # sampled ids do not survive text (a special token or a byte cut mid-answer).
        assert child.spliced
        seen = parent.prompt_token_ids + parent.output_token_ids
        assert child.prompt_token_ids[: len(seen)] == seen
    samples = assemble(turns, {t.id: 1.0 for t in turns})
    trained = [t for s in samples for t, m in zip(s.input_ids, s.loss_mask, strict=True) if m]
    assert trained == [tok for t in turns for tok in t.output_token_ids]


def test_prefix_linking_and_the_episode_header(gateway_server, run):
    http = httpx.Client(
        base_url=gateway_server.url, headers={"Authorization": f"Bearer {run['api_key']}"}
    )
    first = http.post(
        "/v1/chat/completions",
        json={
            "model": run["name"],
            "max_tokens": 6,
            "messages": [{"role": "user", "content": "a river runs past the garden"}],
        },
    )
    assert first.status_code == 200
    episode = first.headers["X-Rlgate-Episode-Id"]
    assert episode == first.json()["episode_id"]
    second = http.post(
        "/v1/chat/completions",
        json={
            "model": run["name"],
            "max_tokens": 6,
            "messages": [
                {"role": "user", "content": "a river runs past the garden"},
                {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                {"role": "user", "content": "and the forest?"},
            ],
        },
    )
    assert second.headers["X-Rlgate-Episode-Id"] == episode
    info = httpx.get(
        f"{gateway_server.url}/admin/v1/runs/{run['run_id']}",
        headers=gateway_server.admin_headers(),
    ).json()
    assert info["calls_by_link"]["new"] >= 1 and info["calls_by_link"]["prefix"] >= 1
    row = gateway_server.completion(second.json()["id"])
    assert row["link"] == "prefix" and row["parent_id"] == first.json()["id"]


def test_retries_are_siblings_and_the_earlier_is_an_orphan(gateway_server, run):
    client = _client(run, **{"X-Episode-Id": "ep-retry"})
    msgs = [{"role": "user", "content": "hello"}]
    a = client.chat.completions.create(model=run["name"], messages=msgs, max_tokens=4)
    b = client.chat.completions.create(model=run["name"], messages=msgs, max_tokens=4)
    turns = _turns(gateway_server, [a.id, b.id])
    assert turns[0].prompt_hash == turns[1].prompt_hash and turns[0].parent_id is None
    samples = assemble(turns, {a.id: 1.0, b.id: 1.0})
    assert [s.input_ids for s in samples] == [turns[1].prompt_token_ids + turns[1].output_token_ids]


def test_a_new_turn_reopens_an_episode_rewarded_per_turn(gateway_server, run):
    client = _client(run, **{"X-Episode-Id": "ep-reopen"})
    http = httpx.Client(
        base_url=gateway_server.url, headers={"Authorization": f"Bearer {run['api_key']}"}
    )
    msgs = [{"role": "user", "content": "hi"}]
    one = client.chat.completions.create(model=run["name"], messages=msgs, max_tokens=4)
    assert (
        http.post("/v1/rewards", json={"completion_id": one.id, "reward": 1.0}).json()[
            "episode_status"
        ]
        == "rewarded"
    )
    msgs += [
        {"role": "assistant", "content": one.choices[0].message.content},
        {"role": "user", "content": "more"},
    ]
    two = client.chat.completions.create(model=run["name"], messages=msgs, max_tokens=4)
    q = "SELECT status, reward FROM episodes WHERE id = 'ep-reopen'"
    assert gateway_server.query(q) == [("open", None)]
    ack = http.post("/v1/rewards", json={"completion_id": two.id, "reward": 0.5}).json()
    assert ack["episode_status"] == "rewarded"
    assert gateway_server.query(q) == [("rewarded", 1.5)]  # the sum of both turns


def test_n_choices_form_a_group_of_their_own(gateway_server, run, template):
    http = httpx.Client(
        base_url=gateway_server.url, headers={"Authorization": f"Bearer {run['api_key']}"}
    )
    resp = http.post(
        "/v1/chat/completions",
        json={
            "model": run["name"],
            "n": 4,
            "max_tokens": 6,
            "seed": 3,
            "messages": [{"role": "user", "content": "one plus two?"}],
        },
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    group = resp.headers["X-Rlgate-Group-Id"]
    assert body["group_id"] == group and len(body["choices"]) == 4
    rows = [gateway_server.completion(c["completion_id"]) for c in body["choices"]]
    for choice, row in zip(body["choices"], rows, strict=True):
        # each choice is captured token-exact, as its own episode
        assert template.decode(row["output_token_ids"]) == choice["message"]["content"]
        assert row["episode_id"] == choice["episode_id"]
    assert len({r["episode_id"] for r in rows}) == 4
    episodes = gateway_server.query(
        "SELECT DISTINCT group_id FROM episodes WHERE id IN (?, ?, ?, ?)",
        tuple(r["episode_id"] for r in rows),
    )
    assert episodes == [(group,)]
    assert body["usage"]["completion_tokens"] == sum(len(r["output_token_ids"]) for r in rows)
    acks = http.post(
        "/v1/rewards",
        json=[
            {"completion_id": c["completion_id"], "reward": float(i)}
            for i, c in enumerate(body["choices"])
        ],
    ).json()
    assert [a["episode_id"] for a in acks] == [c["episode_id"] for c in body["choices"]]
