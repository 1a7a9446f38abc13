"""Two OpenAI Agents SDK agents, each its own trainable policy of one rlgate run.

A planner writes a plan and hands the task to a writer, a sub-agent that starts
from a fresh context (the plan as its only input). Both agents' clients use the
episode's path-scoped base_url, so the writer's calls join the planner's episode
although nothing in its context links them; each agent's `model` names its
policy (`<run name>/<policy>`). The reward then trains each policy on its own turns.

The run declares the policies when it is created (docs/policies.md):

    curl -X POST $RLGATE_URL/admin/v1/runs -H "Authorization: Bearer $RLGATE_ADMIN_KEY" \\
        -d '{"name": "team", "model": "smollm2",
             "config": {"lora_rank": 8, "policies": {"planner": {}, "writer": {}}}}'
    RLGATE_BASE_URL=http://127.0.0.1:8000/v1 RLGATE_API_KEY=rlg-... RLGATE_MODEL=team \\
        python examples/policies_agents.py
"""

import asyncio
import os
import uuid

import httpx
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from openai import AsyncOpenAI

base_url, api_key, run = (
    os.environ[k] for k in ("RLGATE_BASE_URL", "RLGATE_API_KEY", "RLGATE_MODEL")
)
root = base_url.removesuffix("/v1")
set_tracing_disabled(True)  # no traces to OpenAI's servers


def agent(name: str, instructions: str, client: AsyncOpenAI) -> Agent:
    """An agent whose model is the run's policy `name`."""
    return Agent(
        name=name,
        instructions=instructions,
        model=OpenAIChatCompletionsModel(model=f"{run}/{name}", openai_client=client),
        model_settings=ModelSettings(max_tokens=32),
    )


async def main() -> None:
    episode = f"team-{uuid.uuid4().hex[:8]}"
    # One client for the episode: every call through it is filed under `episode`.
    client = AsyncOpenAI(base_url=f"{root}/episodes/{episode}/v1", api_key=api_key)
    planner = agent("planner", "Plan the answer in one short sentence.", client)
    writer = agent("writer", "Write the final answer following the plan.", client)

    plan = await Runner.run(planner, "How do I greet a new colleague?", max_turns=2)
    print("plan:", plan.final_output)
    final = await Runner.run(writer, f"Plan: {plan.final_output}", max_turns=2)  # fresh context
    print("final output:", final.final_output)

    headers = {"Authorization": f"Bearer {api_key}"}
    async with httpx.AsyncClient(base_url=f"{root}/v1", headers=headers) as http:
        # One reward for the episode trains both policies, each on its own turns; a reward
        # with "policy" trains that policy only (here: the writer's answer scored again).
        acks = (
            await http.post(
                "/rewards",
                json=[
                    {"episode_id": episode, "reward": 1.0},
                    {"episode_id": episode, "policy": "writer", "reward": 0.5},
                ],
            )
        ).json()
    for ack in acks:
        print("episode", ack["episode_id"], "policy", ack["policy"], "is", ack["episode_status"])


asyncio.run(main())
