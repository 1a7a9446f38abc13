"""OpenAI fidelity details through a real gateway: stop strings, roles, refusals, 429."""

from __future__ import annotations

import openai
import pytest

from inference.reasoning import split_reasoning

pytestmark = pytest.mark.integration

MSGS = [{"role": "user", "content": "tell me about the garden"}]


@pytest.fixture(scope="module")
def run(gateway_server) -> dict:
    return gateway_server.create_run(name="fidelity")


@pytest.fixture(scope="module")
def oai(run) -> openai.OpenAI:
    return openai.OpenAI(base_url=run["base_url"], api_key=run["api_key"])


def _stop_inside(text: str) -> str:
    """Two characters first seen past the third: the text is cut there, not at its start."""
    for i in range(3, len(text) - 2):
        cand = text[i : i + 2]
        if cand.strip() and text.find(cand) == i:
            return cand
    # The text is greedy on the tiny model (built from a fixed seed): the same on every run.
    raise AssertionError(f"no stop string to pick from the greedy text {text!r}")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_the_text_before_them(gateway_server, run, oai, stream) -> None:
    full = (
        oai.chat.completions.create(
            model=run["name"], messages=MSGS, max_tokens=40, temperature=0.0
        )
        .choices[0]
        .message.content
    )
    stop = _stop_inside(full)
    kwargs = {
        "model": run["name"],
        "messages": MSGS,
        "max_tokens": 40,
        "temperature": 0.0,
        "stop": [stop],
    }
    if stream:
        chunks = list(oai.chat.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        cid = chunks[0].id
    else:
        resp = oai.chat.completions.create(**kwargs)
        text, finish, cid = resp.choices[0].message.content, resp.choices[0].finish_reason, resp.id
    assert text == full[: full.index(stop)]
    assert finish == "stop"
    row = gateway_server.completion(cid)
    assert row["content"] == text
    # the ids keep everything sampled, including the tokens that formed the stop string
    assert len(row["output_token_ids"]) < 40


def test_developer_role_is_accepted(oai, run) -> None:
    resp = oai.chat.completions.create(
        model=run["name"],
        max_tokens=4,
        messages=[{"role": "developer", "content": "be brief"}, *MSGS],
    )
    assert resp.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("frequency_penalty", 0.5),
        ("presence_penalty", -1.0),
        ("response_format", {"type": "json_object"}),
    ],
)
def test_unsupported_sampling_is_a_clear_400(gateway_server, oai, run, field, value) -> None:
    before = gateway_server.count("completions")
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(
            model=run["name"], messages=MSGS, max_tokens=2, **{field: value}
        )
    assert exc.value.body["param"] == field
    assert gateway_server.count("completions") == before


def test_paused_run_answers_429_with_retry_after(gateway_server) -> None:
    import sqlite3

    import httpx

    run = gateway_server.create_run(name="paused")
    conn = sqlite3.connect(gateway_server.db_path, timeout=10)
    conn.execute("UPDATE runs SET status = 'paused' WHERE id = ?", (run["run_id"],))
    conn.commit()
    conn.close()
    resp = httpx.post(
        f"{gateway_server.url}/v1/chat/completions",
        json={"model": run["name"], "messages": MSGS, "max_tokens": 2},
        headers={"Authorization": f"Bearer {run['api_key']}"},
    )
    assert resp.status_code == 429
    assert resp.headers["Retry-After"] == "5"
    assert resp.json()["error"]["type"] == "rate_limit_error"


def test_reasoning_split() -> None:
    assert split_reasoning("<think>add them</think> 3") == ("add them", "3")
    assert split_reasoning("3 <think>late</think>") == (None, "3 <think>late</think>")


def test_pending_capacity_turns_new_conversations_away(gateway_server) -> None:
    import httpx

    # admission_wait_s 0: answer at once instead of holding the call (the default holds it)
    run = gateway_server.create_run(
        name="capacity", config={"max_pending_episodes": 2, "admission_wait_s": 0}
    )
    http = httpx.Client(
        base_url=gateway_server.url,
        headers={"Authorization": f"Bearer {run['api_key']}"},
        timeout=60,  # the run's first call loads its model
    )
    body = {"model": run["name"], "messages": MSGS, "max_tokens": 2}
    first = [http.post("/v1/chat/completions", json=body) for _ in range(2)]
    assert [r.status_code for r in first] == [200, 200]
    third = http.post("/v1/chat/completions", json=body)
    assert third.status_code == 429 and third.headers["Retry-After"] == "60"  # SDK honours it
    # a later turn of a waiting episode is not new traffic: it goes on
    follow = http.post(
        "/v1/chat/completions",
        json={
            **body,
            "messages": [
                *MSGS,
                {
                    "role": "assistant",
                    "content": first[0].json()["choices"][0]["message"]["content"],
                },
                {"role": "user", "content": "more"},
            ],
        },
    )
    assert follow.status_code == 200
    # both first calls may have sampled the same two tokens: the turn links to either episode
    assert follow.json()["episode_id"] in {r.json()["episode_id"] for r in first}
