"""An unmodified OpenAI-SDK agent on rlgate: chat, streaming, tools, n samples, rewards.

Run against a gateway (`rlgate up`) and a run (`rlgate runs create ... --json`):

    RLGATE_BASE_URL=http://127.0.0.1:8000/v1 RLGATE_API_KEY=rlg-... RLGATE_MODEL=my-run \\
        python examples/openai_sdk.py
"""

import json
import os

import httpx
import openai

base_url = os.environ["RLGATE_BASE_URL"]  # the run's base_url, ending in /v1
api_key = os.environ["RLGATE_API_KEY"]
model = os.environ["RLGATE_MODEL"]
root = base_url.removesuffix("/v1")

# 1. One episode: the only change to the agent is a path-scoped base_url.
agent = openai.OpenAI(base_url=f"{root}/episodes/example-1/v1", api_key=api_key)
messages = [{"role": "user", "content": "What is 2 + 3? Reply with only the number."}]
reply = agent.chat.completions.create(model=model, messages=messages, max_tokens=16)
print("reply:", reply.choices[0].message.content, "| sampled by", reply.system_fingerprint)

# 2. A second turn: rlgate splices its own sampled ids back in (token-exact).
messages += [
    reply.choices[0].message.model_dump(include={"role", "content"}),
    {"role": "user", "content": "Are you sure?"},
]
stream = agent.chat.completions.create(model=model, messages=messages, max_tokens=16, stream=True)
print("streamed:", "".join(c.choices[0].delta.content or "" for c in stream if c.choices))

# 3. Tools: offered to the model; a call comes back as message.tool_calls.
add = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        },
    },
}
tooled = agent.chat.completions.create(model=model, messages=messages, tools=[add], max_tokens=32)
for call in tooled.choices[0].message.tool_calls or []:
    print("tool call:", call.function.name, json.loads(call.function.arguments))

# 4. n samples of one prompt form a GRPO group; reward each choice by its completion_id.
group = agent.chat.completions.create(model=model, messages=messages[:1], n=4, max_tokens=16)
rewards = [
    {
        "completion_id": c.model_extra["completion_id"],
        "reward": float((c.message.content or "").strip() == "5"),
    }
    for c in group.choices
]
headers = {"Authorization": f"Bearer {api_key}"}
acks = httpx.post(f"{root}/v1/rewards", json=rewards, headers=headers).raise_for_status().json()
print("group rewards:", [a["reward"] for a in acks])

# 5. The episode's reward, once it is over.
ack = (
    httpx.post(
        f"{root}/v1/rewards", json={"episode_id": "example-1", "reward": 1.0}, headers=headers
    )
    .raise_for_status()
    .json()
)
print("episode", ack["episode_id"], "is", ack["episode_status"])
