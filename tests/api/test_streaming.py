"""Streaming chat completions through a real gateway with the official openai client."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.integration

MSGS = [{"role": "user", "content": "tell me about the river"}]


@pytest.fixture(scope="module")
def run(gateway_server) -> dict:
    return gateway_server.create_run(name="stream")


@pytest.fixture(scope="module")
def template(tiny_model_dir):
    from inference.chat_template import ChatTemplate

    return ChatTemplate(tiny_model_dir)


def test_stream_delivers_exactly_the_stored_sample(gateway_server, run, template):
    client = openai.OpenAI(base_url=run["base_url"], api_key=run["api_key"])
    chunks = list(
        client.chat.completions.create(
            model=run["name"],
            messages=MSGS,
            max_tokens=24,
            stream=True,
            seed=5,
            logprobs=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert len(finish) == 1 and finish[0] in ("stop", "length")
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert len({c.id for c in chunks}) == 1
    row = gateway_server.completion(chunks[0].id)
    assert row is not None and row["finish_reason"] in ("stop", "length")
    assert template.decode(row["output_token_ids"]) == text == row["content"]
    assert usage.completion_tokens == len(row["output_token_ids"])
    assert usage.prompt_tokens == len(row["prompt_token_ids"])
    streamed_lps = [
        t.logprob
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert streamed_lps == pytest.approx(row["output_logprobs"], abs=1e-5)
    # more than role + one content + finish: the tokens really arrived one by one
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1


def test_async_stream_matches_non_streaming_with_the_same_seed(run):
    async def go() -> tuple[str, str]:
        client = openai.AsyncOpenAI(base_url=run["base_url"], api_key=run["api_key"])
        plain = await client.chat.completions.create(
            model=run["name"], messages=MSGS, max_tokens=16, temperature=0.0
        )
        stream = await client.chat.completions.create(
            model=run["name"], messages=MSGS, max_tokens=16, temperature=0.0, stream=True
        )
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        await client.close()
        return plain.choices[0].message.content, "".join(parts)

    plain, streamed = asyncio.run(go())
    assert streamed == plain


def test_disconnect_cancels_and_stores_the_partial_sample(gateway_server, run):
    http = httpx.Client(
        base_url=gateway_server.url,
        headers={"Authorization": f"Bearer {run['api_key']}"},
        timeout=60,
    )
    budget = 900
    # Greedy on the tiny model (built from a fixed seed): this prompt's answer runs the whole
    # budget on every run, so the disconnect below always lands mid-generation.
    msgs = [{"role": "user", "content": "river"}]
    probe = http.post(
        "/v1/chat/completions",
        json={"model": run["name"], "messages": msgs, "max_tokens": budget, "temperature": 0.0},
    ).json()
    assert probe["choices"][0]["finish_reason"] == "length", "greedy 'river' now stops early"
    with http.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "model": run["name"],
            "messages": msgs,
            "max_tokens": budget,
            "temperature": 0.0,
            "stream": True,
        },
    ) as resp:
        for line in resp.iter_lines():  # read up to the first sampled text, then hang up
            if line.startswith("data: "):
                chunk = json.loads(line[len("data: ") :])
                if chunk["choices"][0]["delta"].get("content"):
                    break
        completion_id = chunk["id"]
    # the server notices the disconnect, stops sampling and stores what it had
    for _ in range(100):
        row = gateway_server.completion(completion_id)
        if row is not None:
            break
        time.sleep(0.1)
    assert row is not None, "the partial completion was not stored"
    assert row["finish_reason"] == "cancelled"
    assert 0 < len(row["output_token_ids"]) < budget
    assert (
        row["output_token_ids"] == probe_ids(gateway_server, probe)[: len(row["output_token_ids"])]
    )


def probe_ids(gateway_server, probe: dict) -> list[int]:
    return gateway_server.completion(probe["id"])["output_token_ids"]
