"""An OpenAI Agents SDK agent on rlgate: point its client at the run's base_url.

    RLGATE_BASE_URL=http://127.0.0.1:8000/v1 RLGATE_API_KEY=rlg-... RLGATE_MODEL=my-run \\
        python examples/agents_sdk_agent.py
"""

import asyncio
import os

import httpx
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.exceptions import MaxTurnsExceeded
from openai import AsyncOpenAI

base_url, api_key, model = (
    os.environ[k] for k in ("RLGATE_BASE_URL", "RLGATE_API_KEY", "RLGATE_MODEL")
)
root = base_url.removesuffix("/v1")
set_tracing_disabled(True)  # no traces to OpenAI's servers


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def main() -> None:
    client = AsyncOpenAI(base_url=f"{root}/episodes/agents-1/v1", api_key=api_key)
    agent = Agent(
        name="adder",
        instructions="Use the add tool, then answer with the number.",
        model=OpenAIChatCompletionsModel(model=model, openai_client=client),
        tools=[add],
        model_settings=ModelSettings(max_tokens=32),
    )
    try:
        result = await Runner.run(agent, "What is 2 + 3?", max_turns=4)
        print("final output:", result.final_output)
    except MaxTurnsExceeded:
        print("the agent ran out of turns (an untrained model may loop on tools)")
    async with httpx.AsyncClient() as http:
        ack = (
            await http.post(
                f"{root}/v1/rewards",
                json={"episode_id": "agents-1", "reward": 0.0},
                headers={"Authorization": f"Bearer {api_key}"},
            )
        ).json()
    print("episode", ack["episode_id"], "is", ack["episode_status"])


asyncio.run(main())
