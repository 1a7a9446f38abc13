"""LangChain's ChatAnthropic with tools on rlgate: only base_url and api_key change.

    RLGATE_BASE_URL=http://127.0.0.1:8000/v1 RLGATE_API_KEY=rlg-... RLGATE_MODEL=my-run \\
        python examples/langchain_anthropic_agent.py
"""

import os

import httpx
from langchain_anthropic import ChatAnthropic
from langchain_core.tools import tool

base_url, api_key, model = (
    os.environ[k] for k in ("RLGATE_BASE_URL", "RLGATE_API_KEY", "RLGATE_MODEL")
)
root = base_url.removesuffix("/v1")


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


# The episode id goes in the path; the group (same task, several attempts) too.
llm = ChatAnthropic(
    base_url=f"{root}/groups/lca-task/episodes/lca-1", api_key=api_key, model=model, max_tokens=32
).bind_tools([add])
answer = llm.invoke("What is 2 + 3?")
print("answer:", answer.content or answer.tool_calls)
print("streamed:", "".join(chunk.text for chunk in llm.stream("And 4 + 4?")))

ack = (
    httpx.post(
        f"{root}/v1/rewards",
        json={"episode_id": "lca-1", "reward": 1.0},
        headers={"x-api-key": api_key},
    )
    .raise_for_status()
    .json()
)
print("episode", ack["episode_id"], "is", ack["episode_status"])
