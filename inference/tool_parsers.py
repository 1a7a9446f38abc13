"""Parse tool calls out of sampled text, per model family, through a small registry.

Each parser turns the decoded text into (content, tool_calls). Text that
looks like a tool call but is not valid JSON of the right shape stays in the
content: a malformed call is the model's answer, never a server error.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParsedToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


ToolParser = Callable[[str], tuple[str, list[ParsedToolCall]]]
_REGISTRY: dict[str, ToolParser] = {}


def register(name: str) -> Callable[[ToolParser], ToolParser]:
    def deco(fn: ToolParser) -> ToolParser:
        _REGISTRY[name] = fn
        return fn

    return deco


def get_parser(name: str) -> ToolParser:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}: one of {sorted(_REGISTRY)}") from None


def parser_names() -> list[str]:
    return sorted(_REGISTRY)


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@register("hermes")
def parse_hermes(text: str) -> tuple[str, list[ParsedToolCall]]:
    """Hermes / Qwen style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks."""
    calls: list[ParsedToolCall] = []
    kept: list[str] = []
    last = 0
    for m in _HERMES.finditer(text):
        call = _call_from_json(m.group(1))
        if call is None:
            continue  # malformed: leave the block in the content
        calls.append(call)
        kept.append(text[last : m.start()])
        last = m.end()
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return content, calls


def _call_from_json(raw: str) -> ParsedToolCall | None:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall("call_" + uuid.uuid4().hex[:24], obj["name"], json.dumps(args))


def hermes_tool_block(name: str, arguments: str) -> str:
    """How a tool call is written back into history for templates without tool support."""
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError:
        args = arguments
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"
