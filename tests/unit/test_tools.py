"""Tool calling: the Hermes parser, the tool prompt, and a parsed call in the stored row."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from gateway.agent.completions import ChatService, Prepared
from gateway.agent.encoders.chat import finish_reason
from gateway.agent.episodes import Placement
from inference.chat_template import ChatTemplate
from inference.tool_parsers import get_parser, parse_hermes
from inference.tool_prompt import history_as_text, with_tools
from inference.types import GenerateResult, SamplingParams

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
    },
}


def test_hermes_parses_calls_and_keeps_surrounding_text() -> None:
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    content, calls = parse_hermes(text)
    assert content == "Let me add."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2})]
    assert calls[0].id.startswith("call_")


def test_hermes_reads_several_calls_and_string_arguments() -> None:
    text = (
        '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>'
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    )
    content, calls = parse_hermes(text)
    assert content == "" and [c.name for c in calls] == ["a", "b"]
    assert json.loads(calls[0].arguments) == {"x": 1}


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "a", "arguments": [1, 2]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "a"',  # never closed
    ],
)
def test_malformed_calls_stay_text(text: str) -> None:
    content, calls = parse_hermes(text)
    assert calls == [] and content == text


def test_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="hermes"):
        get_parser("nope")


def test_tool_prompt_for_a_template_without_tools() -> None:
    msgs = [{"role": "user", "content": "add 1 and 2"}]
    rendered, native = with_tools(msgs, [ADD], "required", native=False)
    assert native is None and rendered[0]["role"] == "system"
    assert '"name": "add"' in rendered[0]["content"] and "must call" in rendered[0]["content"]
    assert rendered[1:] == msgs
    none, _ = with_tools(msgs, [ADD], "none", native=False)
    assert none == msgs  # tool_choice none: no tools in the prompt


def test_history_tool_calls_and_results_become_text() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    out = history_as_text(
        [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "3", "tool_call_id": "c1"},
        ]
    )
    assert out[0]["content"].startswith("<tool_call>") and '"add"' in out[0]["content"]
    assert out[1] == {"role": "tool", "content": "<tool_response>\n3\n</tool_response>"}


def test_a_sampled_tool_call_is_parsed_into_the_row(tiny_model_dir) -> None:
    template = ChatTemplate(tiny_model_dir)
    sampled = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    ids = [*template.encode(sampled), template.stop_token_ids[-1]]
    prep = Prepared(
        run=SimpleNamespace(id="run_x"),
        serving=SimpleNamespace(template=template),
        messages=[{"role": "user", "content": "add"}],
        placement=Placement("ep", None, "new", None),
        prompt_ids=[1, 2],
        spliced=False,
        params=SamplingParams(),
        tool_parser=parse_hermes,
    )
    row = ChatService.completion_row(
        prep, "chatcmpl-x", None, GenerateResult(ids, [0.0] * len(ids), "stop", 0)
    )
    assert row.output_token_ids == ids  # the ids keep the exact sample, tool-call text included
    assert row.content == ""
    assert row.tool_calls[0]["function"] == {"name": "add", "arguments": '{"a": 1}'}
    assert finish_reason(row) == "tool_calls"
