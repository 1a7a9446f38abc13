"""Agent frameworks, unmodified but for base_url: LangChain and the OpenAI Agents SDK
(Chat Completions model). Each call must be captured token-exact."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def run(gateway_server) -> dict:
    return gateway_server.create_run(name="frameworks")


@pytest.fixture(scope="module")
def template(tiny_model_dir):
    from inference.chat_template import ChatTemplate

    return ChatTemplate(tiny_model_dir)


def _newest(gateway_server, n: int = 1) -> list[dict]:
    ids = gateway_server.query(f"SELECT id FROM completions ORDER BY created_at DESC LIMIT {n}")
    return [gateway_server.completion(i) for (i,) in ids]


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def test_langchain_bind_tools_invoke_and_stream(gateway_server, run, template) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=run["base_url"],
        api_key=run["api_key"],
        model=run["name"],
        max_tokens=12,
        temperature=1.0,
    ).bind_tools([add])
    msg = llm.invoke("what is 1 + 2?")
    row = _newest(gateway_server)[0]
    assert isinstance(msg.content, str)
    assert (
        msg.content == row["content"] == template.decode(row["output_token_ids"]) or msg.tool_calls
    )
    assert '"name": "add"' in template.tokenizer.decode(row["prompt_token_ids"])  # tool offered
    streamed = "".join(str(chunk.content) for chunk in llm.stream("and 2 + 3?"))
    row = _newest(gateway_server)[0]
    assert streamed == row["content"] or row["tool_calls"]
    assert len(row["output_logprobs"]) == len(row["output_token_ids"]) > 0


def test_agents_sdk_chat_completions_model(gateway_server, run, template) -> None:
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

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
        model_settings=agents.ModelSettings(max_tokens=12),
    )
    before = gateway_server.count("completions")

    async def go():
        try:
            return await agents.Runner.run(agent, "what is 1 + 2?", max_turns=3)
        except agents.exceptions.MaxTurnsExceeded:
            return None  # the random tiny model may keep calling tools: still a clean run

    result = asyncio.run(go())
    after = gateway_server.count("completions")
    assert after > before
    row = _newest(gateway_server)[0]
    assert template.decode(row["output_token_ids"]).startswith(
        row["content"][:1] if row["content"] else ""
    )
    if result is not None:
        assert result.final_output == row["content"]
