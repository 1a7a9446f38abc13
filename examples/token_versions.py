"""Which policy version sampled each token: `policy_version` and `version_starts`.

A hot swap (`swap_mode: keep`, the default) does not wait for the generations
in flight: they pause between two tokens, the weights change, and they go on
with the new version. An answer then says where each version began, e.g.
`version_starts: [[0, 3], [57, 4]]`; `policy_version` is the oldest (the first
token's). Both are rlgate extension fields: the openai SDK keeps them in
`model_extra`. Nothing else in the agent changes.

Run against a gateway (`rlgate up`) and a run (`rlgate runs create ... --json`):

    RLGATE_BASE_URL=http://127.0.0.1:8000/v1 RLGATE_API_KEY=rlg-... RLGATE_MODEL=my-run \\
        python examples/token_versions.py
"""

import os

import openai

base_url = os.environ["RLGATE_BASE_URL"]  # the run's base_url, ending in /v1
agent = openai.OpenAI(base_url=base_url, api_key=os.environ["RLGATE_API_KEY"])
model = os.environ["RLGATE_MODEL"]
messages = [{"role": "user", "content": "Count from one to twenty in words."}]


def versions(extra: dict | None) -> str:
    extra = extra or {}
    starts = extra.get("version_starts") or [[0, extra.get("policy_version")]]
    return ", ".join(f"from token {i}: v{v}" for i, v in starts)


# Not streamed: the fields sit on the completion.
reply = agent.chat.completions.create(model=model, messages=messages, max_tokens=48)
print("versions:", versions(reply.model_extra))

# Streamed: each chunk names the version the call started on in `system_fingerprint`
# (`rlgate-<run>-v<N>`), and the finish chunk also carries `version_starts` when the
# completion spans versions (known only once the last token is in).
seen: dict = {}
for chunk in agent.chat.completions.create(
    model=model, messages=messages, max_tokens=48, stream=True
):
    if chunk.system_fingerprint and "policy_version" not in seen:
        seen["policy_version"] = int(chunk.system_fingerprint.rsplit("-v", 1)[1])
    if (chunk.model_extra or {}).get("version_starts"):
        seen["version_starts"] = chunk.model_extra["version_starts"]
print("streamed versions:", versions(seen))
