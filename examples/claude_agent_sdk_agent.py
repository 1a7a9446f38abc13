"""A Claude Agent SDK query on rlgate: its bundled Claude Code CLI calls the run's /v1/messages.

    RLGATE_BASE_URL=http://127.0.0.1:8000/v1 RLGATE_API_KEY=rlg-... RLGATE_MODEL=my-run \\
        python examples/claude_agent_sdk_agent.py

A small model needs CLAUDE_CODE_MAX_OUTPUT_TOKENS: the CLI asks for 32000 by default,
and takes an unknown model's context to be a million tokens.
"""

import asyncio
import os
import tempfile

import httpx
from claude_agent_sdk import (
    AssistantMessage,
    ClaudeAgentOptions,
    ResultError,
    ResultMessage,
    TextBlock,
    query,
)

url, api_key, model = (os.environ[k] for k in ("RLGATE_BASE_URL", "RLGATE_API_KEY", "RLGATE_MODEL"))
root = url.removesuffix("/v1")
EPISODE = "claude-agent-1"


async def main() -> None:
    with tempfile.TemporaryDirectory() as home:  # the CLI keeps its sessions out of ~/.claude
        env = {
            "ANTHROPIC_BASE_URL": f"{root}/episodes/{EPISODE}",  # the CLI appends /v1/messages
            "ANTHROPIC_API_KEY": api_key,
            "CLAUDE_CONFIG_DIR": home,
            # Only the gateway is called: no telemetry, error reports, update checks or DNS.
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "DISABLE_AUTOUPDATER": "1",
            # The CLI asks for 32000 tokens by default, more than a small model's context.
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64",
        }
        options = ClaudeAgentOptions(
            model=model,
            system_prompt="Answer briefly.",
            tools=[],  # no built-in tools: a plain chat turn
            max_turns=1,
            setting_sources=[],  # ignore the machine's Claude Code settings and CLAUDE.md
            cwd=home,
            env=env,
        )
        try:
            async for message in query(prompt="What is one plus two?", options=options):
                if isinstance(message, AssistantMessage) and message.error is None:
                    text = "".join(b.text for b in message.content if isinstance(b, TextBlock))
                    print("answer:", repr(text))
                elif isinstance(message, ResultMessage) and not message.is_error:
                    print("result:", repr(message.result))
        except ResultError as e:
            # An answer cut at the output limit is resumed with one more prompt, even at
            # max_turns=1; an untrained model rarely stops, and a small context overflows.
            print("the CLI gave up:", e)
    async with httpx.AsyncClient() as http:
        ack = (
            await http.post(
                f"{root}/v1/rewards",
                json={"episode_id": EPISODE, "reward": 0.0},
                headers={"Authorization": f"Bearer {api_key}"},
            )
        ).json()
    print("episode", ack["episode_id"], "is", ack["episode_status"])


asyncio.run(main())
