"""Agent frameworks, unmodified but for base_url: LangChain and the OpenAI Agents SDK
(Chat Completions model). Each call must be captured token-exact.

Every call is greedy (temperature 0): the tiny model's answer is then the same text on
every run, with no tool call, so each check compares exact values and none is
vacuous. Should the model ever answer with a tool call, the tests fail; they do not
quietly accept it.
"""

from __future__ import annotations

import json

import agents
import pytest
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def run(gateway_server) -> dict:
    return gateway_server.create_run(name="frameworks")


@pytest.fixture(scope="module")
def template(tiny_model_dir):
    from inference.chat_template import ChatTemplate

    return ChatTemplate(tiny_model_dir)


def _newest(gateway_server) -> dict:
    ((cid,),) = gateway_server.query("SELECT id FROM completions ORDER BY created_at DESC LIMIT 1")
    return gateway_server.completion(cid)


def _tool_calls(row: dict) -> list | None:
    """The stored tool calls; the JSON column holds the text 'null' when there are none."""
    return json.loads(row["tool_calls"] or "null")


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def test_langchain_bind_tools_invoke_and_stream(gateway_server, run, template) -> None:
    llm = ChatOpenAI(
        base_url=run["base_url"],
        api_key=run["api_key"],
        model=run["name"],
        max_tokens=12,
        temperature=0.0,
    ).bind_tools([add])
    msg = llm.invoke("what is 1 + 2?")
    row = _newest(gateway_server)
    prompt = template.tokenizer.decode(row["prompt_token_ids"])
    assert "1 + 2" in prompt and '"name": "add"' in prompt  # this call, with the tool offered
    assert msg.tool_calls == [] and _tool_calls(row) is None
    assert msg.content == row["content"] == template.decode(row["output_token_ids"])
    assert row["content"]

    streamed = "".join(str(chunk.content) for chunk in llm.stream("and 2 + 3?"))
    row = _newest(gateway_server)
    assert "2 + 3" in template.tokenizer.decode(row["prompt_token_ids"])  # the stream's own row
    assert _tool_calls(row) is None
    assert streamed == row["content"] == template.decode(row["output_token_ids"])
    assert len(row["output_logprobs"]) == len(row["output_token_ids"]) > 0


def test_agents_sdk_chat_completions_model(gateway_server, run, template) -> None:
    agents.set_tracing_disabled(True)

    @agents.function_tool
    def add_tool(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    client = AsyncOpenAI(base_url=run["base_url"], api_key=run["api_key"])
    model = agents.OpenAIChatCompletionsModel(model=run["name"], openai_client=client)
    agent = agents.Agent(
        name="adder",
        instructions="Add numbers.",
        model=model,
        tools=[add_tool],
        model_settings=agents.ModelSettings(max_tokens=12, temperature=0.0),
    )
    before = gateway_server.count("completions")
    # A text answer ends the run on its first turn; MaxTurnsExceeded would fail the test.
    result = agents.Runner.run_sync(agent, "what is 1 + 2?", max_turns=3)
    assert gateway_server.count("completions") == before + 1
    row = _newest(gateway_server)
    assert _tool_calls(row) is None
    assert result.final_output == row["content"] == template.decode(row["output_token_ids"])
    assert row["content"]
