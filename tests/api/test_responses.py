"""The Responses API (`/v1/responses`) through a real gateway: openai client and Agents SDK."""

from __future__ import annotations

import asyncio
import json
import time

import agents
import httpx
import openai
import pytest

pytestmark = pytest.mark.integration

ADD_TOOL = {
    "type": "function",
    "name": "add",
    "description": "Add two integers.",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
}


@pytest.fixture(scope="module")
def run(gateway_server) -> dict:
    return gateway_server.create_run(name="resp")


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


def stored(gateway_server, resp) -> dict:
    """The completion row behind a response (rlgate's `completion_id` extension)."""
    row = gateway_server.completion((resp.model_extra or {})["completion_id"])
    assert row is not None
    row["messages"] = json.loads(row["messages"])
    return row


def test_string_input(gateway_server, run, client, template):
    resp = client.responses.create(
        model=run["name"], input="what is one plus two?", max_output_tokens=12
    )
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.status in ("completed", "incomplete")
    assert resp.error is None and resp.model == run["name"]
    [item] = resp.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert [p.type for p in item.content] == ["output_text"] and item.content[0].annotations == []
    row = stored(gateway_server, resp)
    assert row["messages"] == [{"role": "user", "content": "what is one plus two?"}]
    assert resp.output_text == row["content"] == template.decode(row["output_token_ids"])
    assert resp.usage.input_tokens == len(row["prompt_token_ids"])
    assert resp.usage.output_tokens == len(row["output_token_ids"])
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert resp.usage.input_tokens_details.cached_tokens == 0
    assert resp.usage.output_tokens_details.reasoning_tokens == 0
    if row["finish_reason"] == "length":
        assert resp.status == "incomplete" and item.status == "incomplete"
        assert resp.incomplete_details.reason == "max_output_tokens"
    else:
        assert resp.status == "completed" and resp.incomplete_details is None
    extra = resp.model_extra or {}
    assert extra["episode_id"] == row["episode_id"] and extra["policy_version"] == 0
    assert resp.text.format.type == "text" and resp.truncation == "disabled"
    assert resp.tools == [] and resp.tool_choice == "auto" and resp.parallel_tool_calls is True


def test_instructions_become_a_leading_system_message(gateway_server, run, client):
    resp = client.responses.create(
        model=run["name"], input="hello", instructions="reply with only the number"
    )
    assert resp.instructions == "reply with only the number"
    assert stored(gateway_server, resp)["messages"] == [
        {"role": "system", "content": "reply with only the number"},
        {"role": "user", "content": "hello"},
    ]


def test_list_of_items_is_translated_to_chat_messages(gateway_server, run, client):
    items = [
        {"role": "developer", "content": "you add numbers"},
        {"role": "user", "content": [{"type": "input_text", "text": "what is 1 + 2?"}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "let me add", "annotations": []}],
        },
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a":1,"b":2}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "3"},
        {"role": "user", "content": "and now?"},
    ]
    resp = client.responses.create(model=run["name"], input=items, max_output_tokens=8)
    msgs = stored(gateway_server, resp)["messages"]
    assert [m["role"] for m in msgs] == ["developer", "user", "assistant", "tool", "user"]
    assert msgs[1]["content"] == "what is 1 + 2?"
    assert msgs[2]["content"] == "let me add"  # the text and the call of one turn
    [call] = msgs[2]["tool_calls"]
    assert call["id"] == "call_1" and call["function"]["name"] == "add"
    assert msgs[3]["tool_call_id"] == "call_1" and msgs[3]["content"] == "3"


def test_previous_response_id_continues_the_conversation(gateway_server, run, client):
    first = client.responses.create(
        model=run["name"], input="first question", instructions="be brief", max_output_tokens=10
    )
    second = client.responses.create(
        model=run["name"],
        input="second question",
        instructions="be brief",
        previous_response_id=first.id,
        max_output_tokens=10,
    )
    assert second.previous_response_id == first.id
    row1, row2 = stored(gateway_server, first), stored(gateway_server, second)
    assert row2["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "second question"},
    ]
    # the chat path links it to the first turn: same episode, parent, spliced when exact
    assert row2["parent_id"] == row1["id"] and row2["episode_id"] == row1["episode_id"]
    if row2["spliced"]:
        sampled = row1["prompt_token_ids"] + row1["output_token_ids"]
        assert row2["prompt_token_ids"][: len(sampled)] == sampled
    # instructions are not carried over (OpenAI's rule); the items are, down the chain
    third = client.responses.create(
        model=run["name"], input="third", previous_response_id=second.id, max_output_tokens=4
    )
    msgs = stored(gateway_server, third)["messages"]
    assert [m["content"] for m in msgs if m["role"] == "user"] == [
        "first question",
        "second question",
        "third",
    ]
    assert all(m["role"] != "system" for m in msgs)


def test_retrieve_and_store_false(run, client):
    kept = client.responses.create(model=run["name"], input="keep me", max_output_tokens=4)
    again = client.responses.retrieve(kept.id)
    assert again.id == kept.id and again.output_text == kept.output_text
    gone = client.responses.create(
        model=run["name"], input="forget me", max_output_tokens=4, store=False
    )
    assert gone.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.create(
            model=run["name"], input="more", previous_response_id=gone.id, max_output_tokens=4
        )


def test_unknown_or_foreign_previous_response_id_is_404(gateway_server, run, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=run["name"], input="x", previous_response_id="resp_nope")
    assert info.value.body["param"] == "previous_response_id"
    other = gateway_server.create_run(name="resp-other")
    theirs = openai.OpenAI(base_url=other["base_url"], api_key=other["api_key"])
    foreign = theirs.responses.create(model=other["name"], input="mine", max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=run["name"], input="x", previous_response_id=foreign.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(foreign.id)


def test_wrong_model_is_404(run, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="gpt-5", input="hi")
    assert info.value.body["code"] == "model_not_found"


def test_stream_events_match_the_final_and_stored_text(gateway_server, run, client):
    with client.responses.create(
        model=run["name"],
        input="tell me about the river",
        max_output_tokens=24,
        stream=True,
        extra_body={"seed": 1},  # rlgate's extension: a reproducible sample
    ) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1  # text arrives as it is sampled
    final = events[-1].response
    text = "".join(deltas)
    assert text == final.output_text == events[-4].text
    row = stored(gateway_server, final)
    assert row["content"] == text
    assert final.usage.output_tokens == len(row["output_token_ids"])
    assert (final.status == "incomplete") == (row["finish_reason"] == "length")
    assert client.responses.retrieve(final.id).output_text == text


def test_async_stream_and_chaining(gateway_server, run):
    async def go():
        client = openai.AsyncOpenAI(base_url=run["base_url"], api_key=run["api_key"])
        first = await client.responses.create(
            model=run["name"], input="hello", max_output_tokens=6, temperature=0
        )
        stream = await client.responses.create(
            model=run["name"],
            input="again",
            previous_response_id=first.id,
            max_output_tokens=6,
            temperature=0,
            stream=True,
        )
        events = [e async for e in stream]
        await client.close()
        return first, events

    first, events = asyncio.run(go())
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text
    row = stored(gateway_server, final)
    assert row["messages"][:2] == [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": first.output_text},
    ]


def test_function_tool_is_accepted(gateway_server, run, client):
    resp = client.responses.create(
        model=run["name"],
        input="what is 2 + 3? use the add tool",
        tools=[ADD_TOOL],
        tool_choice="auto",
        max_output_tokens=16,
    )
    assert resp.tools[0].name == "add"
    stored(gateway_server, resp)
    for item in resp.output:  # whether the random model calls it is up to chance
        if item.type == "function_call":
            assert item.id.startswith("fc_") and item.call_id and item.name == "add"
            assert isinstance(item.arguments, str)
        else:
            assert item.type == "message"


def test_path_scoped_episode(gateway_server, run):
    scoped = openai.OpenAI(
        base_url=f"{gateway_server.url}/episodes/ep-resp-1/v1", api_key=run["api_key"]
    )
    resp = scoped.responses.create(model=run["name"], input="hi", max_output_tokens=4)
    assert (resp.model_extra or {})["episode_id"] == "ep-resp-1"
    assert stored(gateway_server, resp)["link"] == "path"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": []}, "input"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),  # accepted, not rendered
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0]"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0]"),
        ({"input": [{"type": "function_call", "name": "add"}]}, "input[0]"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].name"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text.format"),
        ({"temperature": 5}, "temperature"),
        ({"background": True}, "background"),
    ],
)
def test_bad_requests_are_400(gateway_server, run, http, fields, param):
    before = gateway_server.count("completions")
    body = {"model": run["name"], "input": "hi", "max_output_tokens": 4} | fields
    resp = http.post("/v1/responses", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.json()
    assert gateway_server.count("completions") == before


def test_context_overflow_names_input(run, http):
    resp = http.post(
        "/v1/responses",
        json={"model": run["name"], "input": "word " * 2000, "max_output_tokens": 4},
    )
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert (err["param"], err["code"]) == ("input", "context_length_exceeded")


# --- the OpenAI Agents SDK ---------------------------------------------------------


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_agents_sdk_runs_against_the_gateway(gateway_server, run, streamed):
    agents.set_tracing_disabled(True)

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    async def go() -> agents.RunResult | agents.RunResultStreaming:
        client = openai.AsyncOpenAI(base_url=run["base_url"], api_key=run["api_key"])
        # A seeded sample of the tiny model (built from a fixed seed), the same on every run:
        # text that ends within max_tokens, so the run completes on its first turn. An answer
        # cut at max_tokens (ModelBehaviorError) or a tool loop (MaxTurnsExceeded) fails.
        agent = agents.Agent(
            name="adder",
            instructions="Use the add tool, then answer with the number.",
            tools=[add],
            model=agents.OpenAIResponsesModel(model=run["name"], openai_client=client),
            model_settings=agents.ModelSettings(max_tokens=300, extra_body={"seed": 1}),
        )
        try:
            if streamed:
                result = agents.Runner.run_streamed(agent, "what is 1 + 2?", max_turns=2)
                kinds = {e.type async for e in result.stream_events()}
                assert "raw_response_event" in kinds
            else:
                result = await agents.Runner.run(agent, "what is 1 + 2?", max_turns=2)
            return result
        finally:
            await client.close()

    before = (gateway_server.count("completions"), gateway_server.count("responses"))
    result = asyncio.run(go())
    after = (gateway_server.count("completions"), gateway_server.count("responses"))
    assert after == (before[0] + 1, before[1] + 1)  # one turn, stored as one response
    (text,) = gateway_server.query(
        "SELECT content FROM completions ORDER BY created_at DESC LIMIT 1"
    )[0]
    assert result.final_output == text
    assert text


def test_disconnect_stores_the_partial_sample_and_no_response(gateway_server, run, http):
    budget = 900
    # Greedy on the tiny model (built from a fixed seed): this input's answer runs the whole
    # budget on every run, so the disconnect below always lands mid-generation.
    body = {"model": run["name"], "input": "river", "max_output_tokens": budget, "temperature": 0}
    probe = http.post("/v1/responses", json=body | {"store": False}).json()
    assert probe["status"] == "incomplete", "greedy 'river' now stops early"
    with http.stream("POST", "/v1/responses", json=body | {"stream": True}) as resp:
        for line in resp.iter_lines():  # read up to the first text delta, then hang up
            if line.startswith("data: "):
                event = json.loads(line[len("data: ") :])
                if event["type"] == "response.created":
                    completion_id = event["response"]["completion_id"]
                    response_id = event["response"]["id"]
                if event["type"] == "response.output_text.delta":
                    break
    for _ in range(100):
        row = gateway_server.completion(completion_id)
        if row is not None:
            break
        time.sleep(0.1)
    assert row is not None, "the partial completion was not stored"
    assert row["finish_reason"] == "cancelled"
    assert 0 < len(row["output_token_ids"]) < budget
    assert gateway_server.query("SELECT id FROM responses WHERE id = ?", (response_id,)) == []
