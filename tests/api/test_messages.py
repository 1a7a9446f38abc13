"""Anthropic's Messages API (`/v1/messages`) through a real gateway, with Anthropic's own SDK.

Every call is checked against what the gateway stored: the message id is the
completion id, the text is the decoded output ids, the usage is their count.
A tool-use round trip needs a model that calls a tool: `tool_model` is a copy
of `tiny` whose tokenizer holds the whole call as one added token and whose
weights answer it to every turn (tests/forced_tokens.py, `scripted_model`).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from langchain_anthropic import ChatAnthropic

from inference.chat_template import ChatTemplate
from tests.forced_tokens import ANSWER, FIRST, REASONING, scripted_model, thinking_model

pytestmark = pytest.mark.integration

CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
ADD = {
    "name": "add",
    "description": "Add two integers.",
    "input_schema": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
}
USER = [{"role": "user", "content": "what is one plus two?"}]


def tool_model(tiny_dir: Path, out: Path) -> Path:
    """`tiny` answering `CALL` (one added token) to every chat turn, then its stop token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    wide = out.parent / "wide"
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    tok.add_tokens([CALL])
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    model.resize_token_embeddings(len(tok))
    model.save_pretrained(wide)
    tok.save_pretrained(wide)
    after = ChatTemplate(tiny_dir).render(FIRST)[-1]
    return scripted_model(wide, out, after, [tok.convert_tokens_to_ids(CALL)])


@pytest.fixture(scope="module")
def run(gateway_server) -> dict:
    return gateway_server.create_run("messages")


@pytest.fixture(scope="module")
def tool_run(gateway_server, tiny_model_dir: Path, tmp_path_factory) -> dict:
    model = tool_model(tiny_model_dir, tmp_path_factory.mktemp("tool-model") / "model")
    return gateway_server.create_run("messages-tools", model=str(model))


@pytest.fixture(scope="module")
def template(tiny_model_dir: Path) -> ChatTemplate:
    return ChatTemplate(tiny_model_dir)


def client(gateway_server, run: dict, path: str = "") -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=gateway_server.url + path, api_key=run["api_key"], max_retries=0
    )


def stored(gateway_server, message_id: str) -> dict:
    row = gateway_server.completion(message_id)
    assert row is not None, f"no completion stored under the message id {message_id}"
    row["messages"] = json.loads(row["messages"])
    return row


def check_stored(gateway_server, template: ChatTemplate, message) -> dict:
    """The message is the stored completion: id, text, token counts, logprobs, version."""
    row = stored(gateway_server, message.id)
    text = "".join(b.text for b in message.content if b.type == "text")
    assert template.decode(row["output_token_ids"]) == text
    assert message.usage.output_tokens == len(row["output_token_ids"])
    assert message.usage.input_tokens == len(row["prompt_token_ids"])
    assert len(row["output_logprobs"]) == len(row["output_token_ids"])
    assert all(lp <= 0 for lp in row["output_logprobs"])
    extra = message.model_extra or {}
    assert extra["completion_id"] == message.id and extra["episode_id"] == row["episode_id"]
    assert extra["policy_version"] == row["policy_version"] == 0
    return row


def test_create_is_stored_as_sampled(gateway_server, run, template) -> None:
    msg = client(gateway_server, run).messages.create(
        model=run["name"],
        max_tokens=8,
        system="You are terse.",
        messages=USER,
        # the SDK's create() no longer names the sampling knobs; the API still takes them
        extra_body={"temperature": 0.7, "top_k": 20},
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.stop_reason in ("end_turn", "max_tokens")
    row = check_stored(gateway_server, template, msg)
    assert row["messages"] == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "what is one plus two?"},
    ]
    assert row["temperature"] == pytest.approx(0.7)


def test_async_client_and_path_scoped_episode(gateway_server, run, template) -> None:
    async def main() -> list:
        calls = []
        for i in range(2):
            c = anthropic.AsyncAnthropic(
                base_url=f"{gateway_server.url}/groups/g-msg/episodes/e{i}",
                api_key=run["api_key"],
                max_retries=0,
            )
            calls.append(c.messages.create(model=run["name"], max_tokens=4, messages=USER))
        return await asyncio.gather(*calls)

    for i, msg in enumerate(asyncio.run(main())):
        row = check_stored(gateway_server, template, msg)
        assert row["episode_id"] == f"e{i}"
    groups = gateway_server.query("SELECT group_id FROM episodes WHERE id IN ('e0', 'e1')")
    assert groups == [("g-msg",), ("g-msg",)]


def test_stream_sends_anthropics_events_and_stores_first(gateway_server, run, template) -> None:
    with client(gateway_server, run).messages.stream(
        model=run["name"], max_tokens=8, messages=USER
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[-2] == "message_delta" and kinds[1] == "content_block_start"
    assert "content_block_stop" in kinds and "text" in kinds
    row = check_stored(gateway_server, template, final)
    assert final.stop_reason == ("max_tokens" if len(row["output_token_ids"]) == 8 else "end_turn")


def test_raw_stream_event_order(gateway_server, run) -> None:
    """The wire: `event:` names equal the data's type, ping after message_start."""
    with httpx.stream(
        "POST",
        gateway_server.url + "/v1/messages",
        headers={"x-api-key": run["api_key"], "anthropic-version": "2023-06-01"},
        json={"model": run["name"], "max_tokens": 4, "messages": USER, "stream": True},
        timeout=60,
    ) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data:")]
    assert names == [d["type"] for d in datas]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert datas[-2]["usage"]["output_tokens"] >= 1


def test_tool_use_round_trip_splices(gateway_server, tool_run) -> None:
    c = client(gateway_server, tool_run)
    first = c.messages.create(model=tool_run["name"], max_tokens=8, tools=[ADD], messages=USER)
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert (use.name, use.input) == ("add", {"a": 1, "b": 2})
    history = [
        *USER,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "3"}],
        },
    ]
    second = c.messages.create(model=tool_run["name"], max_tokens=8, tools=[ADD], messages=history)
    row1, row2 = stored(gateway_server, first.id), stored(gateway_server, second.id)
    assert row2["parent_id"] == first.id and row2["episode_id"] == row1["episode_id"]
    assert (row2["spliced"], row2["drift"]) == (1, 0)
    # the sampled ids of turn one sit unchanged inside turn two's prompt
    stream = row1["prompt_token_ids"] + row1["output_token_ids"]
    assert row2["prompt_token_ids"][: len(stream)] == stream
    assert row2["messages"][-1] == {"role": "tool", "tool_call_id": use.id, "content": "3"}


def test_stream_tool_use_with_input_json_delta(gateway_server, tool_run) -> None:
    with client(gateway_server, tool_run).messages.stream(
        model=tool_run["name"], max_tokens=8, tools=[ADD], messages=USER
    ) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "input_json_delta" in deltas
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert use.input == {"a": 1, "b": 2} and final.stop_reason == "tool_use"
    assert stored(gateway_server, final.id)["tool_calls"] is not None


def test_stop_sequence_is_reported(gateway_server, tool_run) -> None:
    msg = client(gateway_server, tool_run).messages.create(
        model=tool_run["name"], max_tokens=8, messages=USER, stop_sequences=['"arguments"']
    )
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", '"arguments"')
    assert msg.content[0].text == '<tool_call>{"name": "add", '


def test_count_tokens_matches_the_stored_prompt(gateway_server, run) -> None:
    c = client(gateway_server, run)
    body = {"model": run["name"], "system": "Count me.", "messages": USER}
    count = c.messages.count_tokens(**body)
    msg = c.messages.create(max_tokens=2, **body)
    assert count.input_tokens == len(stored(gateway_server, msg.id)["prompt_token_ids"]) > 0
    with_tools = c.messages.count_tokens(tools=[ADD], **body)
    assert with_tools.input_tokens > count.input_tokens


def test_an_episode_mixes_messages_and_chat(gateway_server, run) -> None:
    first = client(gateway_server, run).messages.create(
        model=run["name"], max_tokens=6, messages=USER
    )
    oai = openai.OpenAI(base_url=run["base_url"], api_key=run["api_key"])
    second = oai.chat.completions.create(
        model=run["name"],
        max_tokens=4,
        messages=[
            *USER,
            {"role": "assistant", "content": first.content[0].text},
            {"role": "user", "content": "and two plus two?"},
        ],
    )
    row1, row2 = stored(gateway_server, first.id), stored(gateway_server, second.id)
    assert row2["parent_id"] == first.id and row2["episode_id"] == row1["episode_id"]
    assert (row2["spliced"], row2["drift"]) == (1, 0)


def test_reward_by_message_id(gateway_server, run) -> None:
    msg = client(gateway_server, run).messages.create(
        model=run["name"], max_tokens=2, messages=USER
    )
    resp = httpx.post(
        run["base_url"] + "/rewards",
        headers={"x-api-key": run["api_key"]},
        json={"completion_id": msg.id, "reward": 0.5},
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    rows = gateway_server.query("SELECT value FROM rewards WHERE completion_id = ?", (msg.id,))
    assert rows == [(0.5,)]


def test_errors_come_in_anthropics_shape(gateway_server, run) -> None:
    c = client(gateway_server, run)
    with pytest.raises(anthropic.BadRequestError) as bad:
        c.messages.create(
            model=run["name"],
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}
                    ],
                }
            ],
        )
    assert bad.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "messages[0].content[0]: image blocks are not supported: "
            "rlgate serves text-only models",
        },
    }
    raw = httpx.post(
        gateway_server.url + "/v1/messages",
        headers={"x-api-key": run["api_key"]},
        json={"model": run["name"], "messages": USER},
        timeout=30,
    )
    assert raw.status_code == 400
    assert raw.json()["error"] == {
        "type": "invalid_request_error",
        "message": "max_tokens: Field required",
    }
    with pytest.raises(anthropic.NotFoundError) as missing:
        c.messages.create(model="not-this-run", max_tokens=2, messages=USER)
    assert missing.value.body["error"]["type"] == "not_found_error"
    bad_key = anthropic.Anthropic(base_url=gateway_server.url, api_key="sk-nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad_key.messages.create(model=run["name"], max_tokens=2, messages=USER)
    # OpenAI's endpoints keep OpenAI's shape, whichever header carried the key
    chat = httpx.post(
        run["base_url"] + "/chat/completions",
        headers={"x-api-key": run["api_key"]},
        json={"model": run["name"], "messages": []},
        timeout=30,
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"


def test_bearer_auth_works_too(gateway_server, run, template) -> None:
    c = anthropic.Anthropic(
        base_url=gateway_server.url, auth_token=run["api_key"], api_key=None, max_retries=0
    )
    check_stored(
        gateway_server,
        template,
        c.messages.create(model=run["name"], max_tokens=2, messages=USER),
    )


# --- LangChain's ChatAnthropic -----------------------------------------------------------


def chat_anthropic(gateway_server, run: dict, path: str = "") -> ChatAnthropic:
    return ChatAnthropic(
        model=run["name"],
        base_url=gateway_server.url + path,
        api_key=run["api_key"],
        max_tokens=8,
        max_retries=0,
    )


def test_langchain_invoke_and_stream(gateway_server, run, template) -> None:
    reply = chat_anthropic(gateway_server, run).invoke("what is one plus two?")
    row = stored(gateway_server, reply.response_metadata["id"])
    assert template.decode(row["output_token_ids"]) == reply.text
    # LangChain's stream chunks carry no message id: the path names the episode instead
    llm = chat_anthropic(gateway_server, run, "/episodes/lc-stream")
    text = "".join(p.text for p in llm.stream("what is two plus two?"))
    ((message_id,),) = gateway_server.query(
        "SELECT id FROM completions WHERE episode_id = 'lc-stream'"
    )
    assert template.decode(stored(gateway_server, message_id)["output_token_ids"]) == text


def test_langchain_bind_tools(gateway_server, tool_run) -> None:
    llm = chat_anthropic(gateway_server, tool_run).bind_tools([ADD])
    reply = llm.invoke("what is one plus two?")
    assert [(c["name"], c["args"]) for c in reply.tool_calls] == [("add", {"a": 1, "b": 2})]
    row = stored(gateway_server, reply.response_metadata["id"])
    assert json.loads(row["tool_calls"])[0]["function"]["name"] == "add"


# --- thinking ----------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["tagged", "opened"])
def thinker(request, gateway_server, tiny_model_dir: Path, tmp_path_factory) -> dict:
    """A thinking copy of `tiny` (tests/forced_tokens.py) behind a run that does NOT parse
    reasoning: the Messages request's `thinking` turns the split on."""
    kind = request.param
    model, _ = thinking_model(tiny_model_dir, tmp_path_factory.mktemp(kind) / "model", kind)
    return gateway_server.create_run(f"messages-think-{kind}", model=str(model))


THINK = {"type": "enabled", "budget_tokens": 1024}


def test_thinking_comes_back_as_a_thinking_block(gateway_server, thinker) -> None:
    c = client(gateway_server, thinker)
    msg = c.messages.create(model=thinker["name"], max_tokens=16, messages=USER, thinking=THINK)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert (msg.content[0].thinking, msg.content[1].text) == (REASONING, ANSWER)
    assert msg.content[0].signature == msg.id
    row = stored(gateway_server, msg.id)
    assert row["reasoning_content"] == REASONING and row["content"] == ANSWER
    # every sampled id is stored and counted, thinking included
    assert msg.usage.output_tokens == len(row["output_token_ids"])
    # without `thinking` (and a run that does not parse reasoning) the text is as sampled
    plain = c.messages.create(model=thinker["name"], max_tokens=16, messages=USER)
    assert [b.type for b in plain.content] == ["text"] and REASONING in plain.content[0].text


def test_thinking_streams_as_thinking_deltas(gateway_server, thinker) -> None:
    with client(gateway_server, thinker).messages.stream(
        model=thinker["name"], max_tokens=16, messages=USER, thinking=THINK
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    kinds = [d.type for d in deltas]
    assert kinds.index("signature_delta") < kinds.index("text_delta")
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == REASONING
    assert "".join(d.text for d in deltas if d.type == "text_delta") == ANSWER
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].signature == final.id


def test_thinking_sent_back_splices(gateway_server, thinker) -> None:
    """Anthropic's tool use needs thinking blocks sent back; they must not cause drift."""
    c = client(gateway_server, thinker)
    first = c.messages.create(model=thinker["name"], max_tokens=16, messages=USER, thinking=THINK)
    history = [
        *USER,
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": "and?"},
    ]
    second = c.messages.create(
        model=thinker["name"], max_tokens=16, messages=history, thinking=THINK
    )
    row1, row2 = stored(gateway_server, first.id), stored(gateway_server, second.id)
    assert row2["parent_id"] == first.id and (row2["spliced"], row2["drift"]) == (1, 0)
    seen = row1["prompt_token_ids"] + row1["output_token_ids"]
    assert row2["prompt_token_ids"][: len(seen)] == seen
