"""Legacy text completions (`/v1/completions`) through a real gateway with the openai client."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

pytestmark = pytest.mark.integration

PROMPT = "the quick brown fox jumps over"


@pytest.fixture(scope="module")
def run(gateway_server) -> dict:
    return gateway_server.create_run(name="text")


@pytest.fixture(scope="module")
def template(tiny_model_dir):
    from inference.chat_template import ChatTemplate

    return ChatTemplate(tiny_model_dir)


@pytest.fixture(scope="module")
def client(run) -> openai.OpenAI:
    return openai.OpenAI(base_url=run["base_url"], api_key=run["api_key"])


@pytest.fixture(scope="module")
def http(gateway_server, run) -> httpx.Client:
    return httpx.Client(
        base_url=gateway_server.url,
        headers={"Authorization": f"Bearer {run['api_key']}"},
        timeout=60,
    )


def test_string_prompt_is_stored_token_exact(gateway_server, run, client, template):
    resp = client.completions.create(
        model=run["name"], prompt=PROMPT, max_tokens=12, seed=3, logprobs=0
    )
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
    choice = resp.choices[0]
    assert choice.index == 0 and choice.finish_reason in ("stop", "length")
    row = gateway_server.completion(resp.id)
    assert row is not None
    assert row["prompt_token_ids"] == template.encode(PROMPT)  # no chat template
    assert template.decode(row["output_token_ids"]) == choice.text == row["content"]
    assert choice.logprobs.token_logprobs == pytest.approx(row["output_logprobs"], abs=1e-5)
    assert len(choice.logprobs.tokens) == len(row["output_token_ids"])
    assert choice.logprobs.text_offset[0] == 0
    assert choice.logprobs.top_logprobs is None
    assert resp.usage.prompt_tokens == len(row["prompt_token_ids"])
    assert resp.usage.completion_tokens == len(row["output_token_ids"])
    assert resp.system_fingerprint == f"rlgate-{run['run_id']}-v{row['policy_version']}"
    extra = resp.model_extra or {}
    assert extra["episode_id"] == row["episode_id"] and extra["policy_version"] == 0
    assert row["link"] == "new" and row["parent_id"] is None
    assert '"role": "prompt"' in row["messages"]


def test_default_max_tokens_is_sixteen(gateway_server, run, client):
    resp = client.completions.create(model=run["name"], prompt=PROMPT, temperature=0.0)
    row = gateway_server.completion(resp.id)
    assert len(row["output_token_ids"]) <= 16
    if resp.choices[0].finish_reason == "length":
        assert len(row["output_token_ids"]) == 16


def test_token_ids_are_sent_as_given(gateway_server, run, client, template):
    ids = template.encode(PROMPT)
    by_ids = client.completions.create(model=run["name"], prompt=ids, max_tokens=10, temperature=0)
    by_text = client.completions.create(
        model=run["name"], prompt=PROMPT, max_tokens=10, temperature=0
    )
    row = gateway_server.completion(by_ids.id)
    assert row["prompt_token_ids"] == ids
    assert template.decode(row["output_token_ids"]) == by_ids.choices[0].text
    assert by_ids.choices[0].text == by_text.choices[0].text  # same ids, same greedy sample
    # a batch of one list of ids is the same prompt
    nested = client.completions.create(
        model=run["name"], prompt=[ids], max_tokens=10, temperature=0
    )
    assert nested.choices[0].text == by_ids.choices[0].text


def test_echo_with_logprobs(gateway_server, run, client, template):
    resp = client.completions.create(
        model=run["name"], prompt=PROMPT, max_tokens=8, echo=True, logprobs=1, seed=11
    )
    choice = resp.choices[0]
    row = gateway_server.completion(resp.id)
    n_prompt = len(row["prompt_token_ids"])
    assert choice.text == PROMPT + row["content"]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset)
    assert len(lp.tokens) == n_prompt + len(row["output_token_ids"])
    assert lp.token_logprobs[:n_prompt] == [None] * n_prompt  # prompts are not scored
    assert lp.token_logprobs[n_prompt:] == pytest.approx(row["output_logprobs"], abs=1e-5)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert lp.text_offset[n_prompt] == len(PROMPT)
    assert "".join(lp.tokens[:n_prompt]) == PROMPT


def test_stream_delivers_exactly_the_stored_sample(gateway_server, run, client, template):
    chunks = list(
        client.completions.create(
            model=run["name"],
            prompt=PROMPT,
            max_tokens=20,
            seed=5,
            logprobs=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert {c.object for c in chunks} == {"text_completion"}
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert len(finish) == 1 and finish[0] in ("stop", "length")
    row = gateway_server.completion(chunks[0].id)
    assert row is not None and row["finish_reason"] in ("stop", "length")
    assert template.decode(row["output_token_ids"]) == text == row["content"]
    lps = [
        x
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for x in c.choices[0].logprobs.token_logprobs
    ]
    assert lps == pytest.approx(row["output_logprobs"], abs=1e-5)
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == len(row["output_token_ids"])
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) > 1


def test_stream_echo_sends_the_prompt_first(run, client):
    chunks = list(
        client.completions.create(
            model=run["name"], prompt=PROMPT, max_tokens=4, echo=True, stream=True
        )
    )
    assert chunks[0].choices[0].text == PROMPT


def test_async_stream_matches_non_streaming_greedy(run):
    async def go() -> tuple[str, str]:
        client = openai.AsyncOpenAI(base_url=run["base_url"], api_key=run["api_key"])
        plain = await client.completions.create(
            model=run["name"], prompt=PROMPT, max_tokens=16, temperature=0.0
        )
        stream = await client.completions.create(
            model=run["name"], prompt=PROMPT, max_tokens=16, temperature=0.0, stream=True
        )
        parts = [c.choices[0].text async for c in stream if c.choices]
        await client.close()
        return plain.choices[0].text, "".join(parts)

    plain, streamed = asyncio.run(go())
    assert streamed == plain


def test_episode_from_path_and_metadata_and_reward(gateway_server, run, http):
    scoped = openai.OpenAI(
        base_url=f"{gateway_server.url}/groups/g-text/episodes/ep-text-1/v1",
        api_key=run["api_key"],
    )
    resp = scoped.completions.create(model=run["name"], prompt=PROMPT, max_tokens=4)
    row = gateway_server.completion(resp.id)
    assert row["episode_id"] == "ep-text-1" and row["link"] == "path"
    group = gateway_server.query("SELECT group_id FROM episodes WHERE id = ?", ("ep-text-1",))
    assert group == [("g-text",)]
    meta = http.post(
        "/v1/completions",
        json={
            "model": run["name"],
            "prompt": PROMPT,
            "max_tokens": 4,
            "metadata": {"episode_id": "ep-text-meta"},
        },
    )
    assert meta.status_code == 200 and meta.headers["X-Rlgate-Episode-Id"] == "ep-text-meta"
    assert gateway_server.completion(meta.json()["id"])["link"] == "metadata"
    ack = http.post("/v1/rewards", json={"completion_id": resp.id, "reward": 1.0})
    assert ack.status_code == 200, ack.text
    assert ack.json()["episode_id"] == "ep-text-1"


@pytest.mark.parametrize(
    ("prompt", "needle"),
    [
        (["one", "two"], "batch of 2"),
        ([[1, 2], [3, 4]], "batch of 2"),
        ([], "empty"),
        ([1, "a"], "prompt must be"),
        ([1, 2.5], "prompt must be"),
        ([True, 1], "prompt must be"),
        ([-1], "outside the vocabulary"),
        ([10**6], "outside the vocabulary"),
        ([[]], "prompt[0]"),
        ([[1, True]], "prompt[0]"),
        ("", "empty"),
        (None, "required"),
        ({"text": "hi"}, "prompt"),
    ],
)
def test_bad_prompts_are_400_naming_prompt(gateway_server, run, http, prompt, needle):
    before = gateway_server.count("completions")
    resp = http.post(
        "/v1/completions", json={"model": run["name"], "prompt": prompt, "max_tokens": 4}
    )
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "prompt" and needle in err["message"], err
    assert gateway_server.count("completions") == before


@pytest.mark.parametrize(
    ("fields", "status", "param", "code"),
    [
        ({"max_tokens": 5000}, 400, "prompt", "context_length_exceeded"),
        ({"n": 2}, 400, "n", None),
        ({"best_of": 3}, 400, "best_of", None),
        ({"logprobs": 6}, 400, "logprobs", "invalid_value"),
        ({"max_tokens": 0}, 400, "max_tokens", "invalid_value"),
        ({"temperature": 3}, 400, "temperature", "invalid_value"),
        ({"suffix": "tail"}, 400, "suffix", None),
        ({"model": "not-this-one"}, 404, "model", "model_not_found"),
    ],
)
def test_bad_requests(gateway_server, run, http, fields, status, param, code):
    before = gateway_server.count("completions")
    body = {"model": run["name"], "prompt": PROMPT, "max_tokens": 4} | fields
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert (err["param"], err["code"]) == (param, code), err
    assert gateway_server.count("completions") == before


def test_openai_client_raises_on_bad_prompt(run, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=run["name"], prompt=["a", "b"], max_tokens=4)
    assert info.value.body["param"] == "prompt"
