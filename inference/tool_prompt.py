"""Put tools into the prompt: natively when the chat template knows them, else Hermes-style.

A template that does not mention `tools` (SmolLM2's, the tiny model's) gets a
system message listing the functions in `<tools>` tags and asking for
`<tool_call>` blocks, which `tool_parsers.parse_hermes` reads back. History
is rendered to match: an assistant message's tool calls become `<tool_call>`
blocks in its text, and a tool result becomes a `tool` message wrapped in
`<tool_response>`.

`tool_choice` "required" or a named function is asked for in the prompt; the
local backend has no constrained decoding, so it is a request to the model,
not a guarantee (documented).
"""

from __future__ import annotations

import json
from typing import Any

from inference.tool_parsers import hermes_tool_block

_PREAMBLE = (
    "You can call functions to help with the user's request. "
    "The available functions are listed, as JSON signatures, between <tools> and </tools>:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with one JSON object per call, each between <tool_call> and "
    "</tool_call>, in this form:\n"
    '<tool_call>\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n</tool_call>'
)


def tool_choice_hint(tool_choice: Any) -> str:
    if tool_choice == "required":
        return "\nYou must call at least one function."
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
        if name:
            return f"\nYou must call the function {name}."
    return ""


def history_as_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool calls and tool results as plain text, for templates without tool support."""
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            blocks = [
                hermes_tool_block(c["function"]["name"], c["function"].get("arguments", "{}"))
                for c in m["tool_calls"]
            ]
            text = "\n".join(filter(None, [m.get("content") or "", *blocks]))
            out.append({"role": "assistant", "content": text})
        elif m.get("role") == "tool":
            out.append(
                {
                    "role": "tool",
                    "content": f"<tool_response>\n{m.get('content', '')}\n</tool_response>",
                }
            )
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    return out


def with_tools(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    native: bool,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages to render, tools to hand to the template natively or None)."""
    # Chat templates know "system"; OpenAI's "developer" role means the same to them.
    messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
    active = bool(tools) and tool_choice != "none"
    if native:
        return messages, (tools if active else None)
    rendered = history_as_text(messages)
    if not active:
        return rendered, None
    signatures = "\n".join(json.dumps(t.get("function", t)) for t in tools or [])
    system = _PREAMBLE.format(tools=signatures) + tool_choice_hint(tool_choice)
    if rendered and rendered[0]["role"] in ("system", "developer"):
        first = rendered[0]
        rendered = [
            {"role": first["role"], "content": first["content"] + "\n\n" + system},
            *rendered[1:],
        ]
    else:
        rendered = [{"role": "system", "content": system}, *rendered]
    return rendered, None
