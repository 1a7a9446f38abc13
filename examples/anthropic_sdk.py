"""An agent written for Anthropic's API, on rlgate: only base_url and api_key change.

    RLGATE_BASE_URL=http://127.0.0.1:8000/v1 RLGATE_API_KEY=rlg-... RLGATE_MODEL=my-run \\
        python examples/anthropic_sdk.py

Anthropic's SDK adds `/v1/messages` to its base_url itself, so the base_url
is rlgate's root (here with the episode and its group in the path).
"""

import os

import anthropic
import httpx

base_url, api_key, model = (
    os.environ[k] for k in ("RLGATE_BASE_URL", "RLGATE_API_KEY", "RLGATE_MODEL")
)
root = base_url.removesuffix("/v1")
client = anthropic.Anthropic(base_url=f"{root}/groups/sums/episodes/claude-1", api_key=api_key)

question = [{"role": "user", "content": "What is 2 + 3?"}]
print("prompt tokens:", client.messages.count_tokens(model=model, messages=question).input_tokens)
first = client.messages.create(model=model, max_tokens=32, messages=question)
print("answer:", first.content[0].text, f"({first.stop_reason})")

# The second turn sends the first answer back as it came; rlgate continues the episode
# from the exact tokens it sampled. Streamed this time.
history = [
    *question,
    {"role": "assistant", "content": first.content},
    {"role": "user", "content": "And 4 + 4?"},
]
with client.messages.stream(model=model, max_tokens=32, messages=history) as stream:
    print("streamed:", "".join(stream.text_stream))

ack = (
    httpx.post(
        f"{root}/v1/rewards",
        json={"episode_id": "claude-1", "reward": 1.0},
        headers={"x-api-key": api_key},
    )
    .raise_for_status()
    .json()
)
print("episode", ack["episode_id"], "is", ack["episode_status"])
