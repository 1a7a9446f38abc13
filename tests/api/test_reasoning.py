"""`reasoning_parser: think` through a real gateway (issue #24): chat, streaming, Responses.

Two thinking copies of `tiny` (with `<think>` and `</think>` added as tokens,
as Qwen3 and DeepSeek-R1 have them) answer a fixed script to every turn:
`tagged` samples `<think>one plus two</think> It is 3`; `opened` has a
template whose generation prompt already opened the block (`<think>\\n`, as
Qwen3's does), so it samples `one plus two</think> It is 3`. Either way the
client gets the thinking apart from the answer, and the store keeps every
sampled id, thinking included.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

import agents
import httpx
import openai
import pytest

from tests.forced_tokens import (
    ANSWER,
    FIRST,
    REASONING,
    SCRIPTS,
    assert_spliced,
    thinking_model,
)

if TYPE_CHECKING:
    from tests.conftest import GatewayServer

pytestmark = pytest.mark.integration

ADD_TOOL = {
    "type": "function",
    "function": {"name": "add", "parameters": {"type": "object", "properties": {}}},
}


@pytest.fixture(scope="module", params=["tagged", "opened"])
def thinking(
    request, gateway_server: GatewayServer, tiny_model_dir: Path, tmp_path_factory
) -> dict:
    """A run with `reasoning_parser: think` on a thinking model; the run's JSON, plus
    `script` (the sampled ids before the stop token) and `n_think` (how many of them think)."""
    kind = request.param
    model, script = thinking_model(tiny_model_dir, tmp_path_factory.mktemp(kind) / "model", kind)
    resp = httpx.post(
        gateway_server.url + "/admin/v1/runs",
        json={
            "name": f"think-{kind}",
            "model": str(model),
            "config": {"reasoning_parser": "think"},
        },
        headers=gateway_server.admin_headers(),
        timeout=60,
    )
    assert resp.status_code == 201, resp.text
    return {**resp.json(), "kind": kind, "script": script, "n_think": SCRIPTS[kind][1]}


@pytest.fixture
def client(thinking: dict) -> openai.OpenAI:
    return openai.OpenAI(base_url=thinking["base_url"], api_key=thinking["api_key"])


def chat(client: openai.OpenAI, run: dict, messages=FIRST, **fields):
    return client.chat.completions.create(
        model=run["name"], messages=messages, temperature=0, **fields
    )


def streamed_chat(client: openai.OpenAI, run: dict, **fields) -> tuple[list, str, str]:
    """The chunks of a streamed chat call, and its joined reasoning and content deltas."""
    chunks = list(chat(client, run, stream=True, **fields))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    return chunks, reasoning, "".join(d.content or "" for d in deltas)


def test_chat_returns_the_thinking_apart_from_the_answer(gateway_server, thinking, client):
    resp = chat(client, thinking)
    message = resp.choices[0].message
    assert (message.reasoning_content, message.content) == (REASONING, ANSWER)
    assert resp.usage.completion_tokens_details.reasoning_tokens == thinking["n_think"]
    row = gateway_server.completion(resp.id)
    assert (row["reasoning_content"], row["content"]) == (REASONING, ANSWER)
    assert row["output_token_ids"][:-1] == thinking["script"]  # the thinking is trained on


@pytest.mark.parametrize("tools", [False, True], ids=["no-tools", "tools"])
def test_stream_sends_reasoning_deltas_then_content_deltas(gateway_server, thinking, client, tools):
    offered = {"tools": [ADD_TOOL]} if tools else {}
    chunks, reasoning, content = streamed_chat(
        client, thinking, logprobs=True, stream_options={"include_usage": True}, **offered
    )
    assert (reasoning, content) == (REASONING, ANSWER)
    kinds = [
        "reasoning" if getattr(d, "reasoning_content", None) else "content"
        for d in (c.choices[0].delta for c in chunks if c.choices)
        if getattr(d, "reasoning_content", None) or d.content
    ]
    assert kinds.count("reasoning") > 1  # streamed as sampled, not sent whole at the end
    if tools:  # the answer might be a tool call: held back, sent whole once sampling ends
        assert kinds.count("content") == 1
    assert kinds == sorted(kinds, reverse=True)  # all reasoning, then all content
    row = gateway_server.completion(chunks[0].id)
    assert (row["reasoning_content"], row["content"]) == (REASONING, ANSWER)
    logprobs = [
        lp
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for lp in c.choices[0].logprobs.content
    ]
    assert len(logprobs) == len(row["output_token_ids"])  # every sampled token, once
    assert [lp.logprob for lp in logprobs] == pytest.approx(row["output_logprobs"], abs=1e-5)
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == thinking["n_think"]


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_thinking_cut_by_max_tokens_is_all_reasoning(gateway_server, thinking, client, stream):
    n = 4  # `<think>one` (tagged) or `one plus` (opened)
    if stream:
        chunks, reasoning, content = streamed_chat(client, thinking, max_tokens=n)
        cid, finish = chunks[0].id, chunks[-1].choices[0].finish_reason
    else:
        resp = chat(client, thinking, max_tokens=n)
        message = resp.choices[0].message
        reasoning, content = message.reasoning_content, message.content
        cid, finish = resp.id, resp.choices[0].finish_reason
    row = gateway_server.completion(cid)
    assert finish == "length"
    assert (reasoning, content) == (row["reasoning_content"], row["content"])
    assert content == "" and reasoning and REASONING.startswith(reasoning)
    assert row["output_token_ids"] == thinking["script"][:n]


def test_responses_answer_a_reasoning_item_before_the_message(gateway_server, thinking, client):
    resp = client.responses.create(model=thinking["name"], input=FIRST[0]["content"], temperature=0)
    assert [item.type for item in resp.output] == ["reasoning", "message"]
    item = resp.output[0]
    assert isinstance(item, openai.types.responses.ResponseReasoningItem)
    assert (item.summary, [(c.type, c.text) for c in item.content]) == (
        [],
        [("reasoning_text", REASONING)],
    )
    assert resp.output_text == ANSWER
    assert resp.usage.output_tokens_details.reasoning_tokens == thinking["n_think"]
    row = gateway_server.completion(resp.model_extra["completion_id"])
    assert (row["reasoning_content"], row["content"]) == (REASONING, ANSWER)


def test_responses_stream_the_reasoning_item(gateway_server, thinking, client):
    with client.responses.stream(
        model=thinking["name"], input=FIRST[0]["content"], temperature=0
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert events[2].item.type == "reasoning"
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == REASONING
    (done,) = [e for e in events if e.type == "response.reasoning_text.done"]
    assert done.text == REASONING
    # The reasoning item is done before the message item begins, as OpenAI streams them.
    added = [i for i, e in enumerate(events) if e.type == "response.output_item.added"]
    assert events[added[1]].item.type == "message"
    assert kinds[added[1] - 3 : added[1]] == [
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == REASONING
    assert final.output_text == ANSWER
    assert final.usage.output_tokens_details.reasoning_tokens == thinking["n_think"]
    assert [e.sequence_number for e in events] == list(range(len(events)))


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_responses_cut_in_the_thinking_is_an_incomplete_reasoning_item(thinking, client, stream):
    fields = {"model": thinking["name"], "input": FIRST[0]["content"], "max_output_tokens": 4}
    if stream:
        with client.responses.stream(**fields) as events:
            last = list(events)[-1]
        assert last.type == "response.incomplete"
        resp = last.response
    else:
        resp = client.responses.create(**fields)
    assert resp.status == "incomplete"
    assert [(item.type, item.status) for item in resp.output] == [
        ("reasoning", "incomplete"),
        ("message", "incomplete"),
    ]
    assert REASONING.startswith(resp.output[0].content[0].text)
    assert resp.output_text == ""


def test_chat_second_turn_echoing_the_answer_splices(gateway_server, thinking, client):
    first = chat(client, thinking)
    message = first.choices[0].message
    echoed = {"role": "assistant", "content": message.content}
    echoed["reasoning_content"] = message.reasoning_content  # as a vLLM client echoes it
    second = chat(client, thinking, messages=[*FIRST, echoed, {"role": "user", "content": "and?"}])
    rows = [gateway_server.completion(r.id) for r in (first, second)]
    assert_spliced(rows)
    assert second.choices[0].message.reasoning_content == REASONING


def test_responses_second_turn_echoing_the_reasoning_item_splices(gateway_server, thinking, client):
    first = client.responses.create(
        model=thinking["name"], input=FIRST[0]["content"], temperature=0
    )
    echoed = [item.to_dict() for item in first.output]  # the reasoning item and the message
    second = client.responses.create(
        model=thinking["name"],
        input=[*FIRST, *echoed, {"role": "user", "content": "and?"}],
        temperature=0,
    )
    chained = client.responses.create(
        model=thinking["name"], input="and?", previous_response_id=first.id, temperature=0
    )
    rows = [gateway_server.completion(r.model_extra["completion_id"]) for r in (first, second)]
    assert_spliced(rows)
    assert_spliced([rows[0], gateway_server.completion(chained.model_extra["completion_id"])])


def test_agents_sdk_second_turn_splices(gateway_server, thinking):
    """The Agents SDK sends the whole history back, reasoning items included, every turn."""
    agents.set_tracing_disabled(True)

    async def go() -> list[str]:
        client = openai.AsyncOpenAI(base_url=thinking["base_url"], api_key=thinking["api_key"])
        agent = agents.Agent(
            name="thinker",
            model=agents.OpenAIResponsesModel(model=thinking["name"], openai_client=client),
            model_settings=agents.ModelSettings(temperature=0),
        )
        try:
            first = await agents.Runner.run(agent, FIRST[0]["content"])
            history = first.to_input_list()
            assert any(item.get("type") == "reasoning" for item in history)
            second = await agents.Runner.run(agent, [*history, {"role": "user", "content": "and?"}])
            return [first.final_output, second.final_output]
        finally:
            await client.close()

    assert asyncio.run(go()) == [ANSWER, ANSWER]
    ids = gateway_server.query(
        "SELECT id FROM completions WHERE run_id = ? ORDER BY created_at DESC LIMIT 2",
        (thinking["run_id"],),
    )
    assert_spliced([gateway_server.completion(i) for (i,) in reversed(ids)])
