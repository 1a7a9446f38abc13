"""Each API family's encoder, fed a hand-built event sequence: the wire format it writes for
text, a tool call, and a backend failure mid-stream (no server, no model)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from core.store.models import Completion
from gateway.agent.encoders.chat import ChatChunks
from gateway.agent.encoders.messages import MessageEvents
from gateway.agent.encoders.responses import ResponseEvents
from gateway.agent.encoders.text import TextChunks
from gateway.agent.events import (
    Done,
    ReasoningDelta,
    StreamError,
    StreamEvent,
    TextDelta,
    Token,
    ToolCallDelta,
)
from gateway.errors import Unavailable
from gateway.protocol import ChatCompletionRequest
from gateway.protocol_legacy import CompletionRequest
from gateway.protocol_messages import MessagesRequest
from gateway.protocol_responses import ResponsesRequest

CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}


def _prep() -> Any:
    """A prepared call: one character per token id, so decoding is visible in the output."""
    decode = lambda ids: "".join(chr(96 + i) for i in ids)  # noqa: E731
    template = SimpleNamespace(
        decode=decode, template_text=decode, tokenizer=SimpleNamespace(decode=decode)
    )
    return SimpleNamespace(
        run=SimpleNamespace(id="run_x"),
        serving=SimpleNamespace(template=template, backend=SimpleNamespace(version=3)),
        placement=SimpleNamespace(episode_id="ep_1"),
        prompt_ids=[1, 2],
        params=SimpleNamespace(stop=()),
        messages=[{"role": "prompt", "content": "ab"}],
    )


def _row(content: str, calls: list[dict[str, Any]] | None = None) -> Completion:
    return Completion(
        id="cmpl_1",
        run_id="run_x",
        episode_id="ep_1",
        prompt_token_ids=[1, 2],
        output_token_ids=[8, 9],
        output_logprobs=[-0.5, -0.25],
        content=content,
        finish_reason="stop",
        tool_calls=calls,
        reasoning_content=None,
        policy_version=3,
    )


def _run(encoder: Any, events: list[StreamEvent]) -> list[Any]:
    out = list(encoder.start())
    for event in events:
        out += encoder.feed(event)
    return out


TEXT = [
    TextDelta("h", (Token(8, -0.5, 0),)),
    TextDelta("i", (Token(9, -0.25, 1),)),
    Done(_row("hi")),
]
TOOL = [ToolCallDelta(0, CALL), Done(_row("", [CALL]))]
BROKEN = [TextDelta("h", (Token(8, -0.5, 0),)), StreamError(Unavailable("the backend failed"))]


def _chat_req(**extra: Any) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **extra}
    return ChatCompletionRequest.model_validate(body)


def test_chat_chunks_of_text_with_logprobs_and_usage() -> None:
    req = _chat_req(logprobs=True, stream_options={"include_usage": True})
    out = _run(ChatChunks(req, _prep(), "chatcmpl-1", 7), TEXT)
    assert [c["choices"][0]["delta"] for c in out[:3]] == [
        {"role": "assistant", "content": ""},
        {"content": "h"},
        {"content": "i"},
    ]
    assert out[1]["choices"][0]["logprobs"] == {"content": [{"token": "h", "logprob": -0.5}]}
    assert out[3]["choices"][0]["finish_reason"] == "stop"
    assert out[4]["choices"] == [] and out[4]["usage"]["total_tokens"] == 4
    assert {c["system_fingerprint"] for c in out} == {"rlgate-run_x-v3"}
    assert {c["episode_id"] for c in out} == {"ep_1"}


def test_chat_chunks_of_a_tool_call_and_of_a_failure() -> None:
    out = _run(ChatChunks(_chat_req(), _prep(), "chatcmpl-1", 7), TOOL)
    assert out[1]["choices"][0]["delta"] == {"tool_calls": [{"index": 0, **CALL}]}
    assert out[2]["choices"][0]["finish_reason"] == "tool_calls"
    broken = _run(ChatChunks(_chat_req(), _prep(), "chatcmpl-1", 7), BROKEN)
    assert broken[-1] == Unavailable("the backend failed").body()


def test_text_chunks_echo_the_prompt_and_offset_logprobs_after_it() -> None:
    req = CompletionRequest(model="m", prompt="ab", echo=True, logprobs=1)
    out = _run(TextChunks(req, _prep(), "cmpl-1", 7), TEXT)
    texts = [c["choices"][0]["text"] for c in out]
    assert texts == ["ab", "h", "i", ""]
    assert out[0]["choices"][0]["logprobs"]["token_logprobs"] == [None, None]
    assert out[2]["choices"][0]["logprobs"]["text_offset"] == [3]  # after "ab" and "h"
    assert out[-1]["choices"][0]["finish_reason"] == "stop"
    broken = _run(TextChunks(req, _prep(), "cmpl-1", 7), BROKEN)
    assert broken[-1]["error"]["message"] == "the backend failed"


def test_text_chunks_ignore_what_a_text_completion_never_parses() -> None:
    req = CompletionRequest(model="m", prompt="ab")
    out = _run(TextChunks(req, _prep(), "cmpl-1", 7), [ReasoningDelta("x"), *TOOL])
    assert [c["choices"][0]["finish_reason"] for c in out] == ["stop"]


def test_response_events_of_text_then_a_tool_call() -> None:
    req = ResponsesRequest(model="m", input="x")
    encoder = ResponseEvents(req, _prep(), "chatcmpl-1")
    out = _run(encoder, [TextDelta("hi"), ToolCallDelta(0, CALL), Done(_row("hi", [CALL]))])
    assert [e["type"] for e in out] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    assert out[2]["item"]["content"] == []  # announced before its part
    final = out[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    assert final["completion_id"] == "cmpl_1" and final["usage"]["output_tokens"] == 2
    assert encoder.response is not None and encoder.response.id == final["id"]


def test_response_events_of_a_failure() -> None:
    req = ResponsesRequest(model="m", input="x")
    out = _run(ResponseEvents(req, _prep(), "chatcmpl-1"), BROKEN)
    assert out[-1]["type"] == "response.failed"
    assert out[-1]["response"]["error"]["code"] == "server_error"
    assert out[-1]["response"]["completion_id"] == "chatcmpl-1"


def test_message_events_of_thinking_text_and_a_tool_call() -> None:
    req = MessagesRequest(model="m", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    events = [ReasoningDelta("hm"), TextDelta("hi"), ToolCallDelta(0, CALL)]
    out = _run(MessageEvents(req, _prep(), "msg_1"), [*events, Done(_row("hi", [CALL]))])
    kinds = [(e["type"], e.get("delta", {}).get("type")) for e in out]
    assert kinds == [
        ("message_start", None),
        ("ping", None),
        ("content_block_start", None),
        ("content_block_delta", "thinking_delta"),
        ("content_block_delta", "signature_delta"),
        ("content_block_stop", None),
        ("content_block_start", None),
        ("content_block_delta", "text_delta"),
        ("content_block_stop", None),
        ("content_block_start", None),
        ("content_block_delta", "input_json_delta"),
        ("content_block_stop", None),
        ("message_delta", None),
        ("message_stop", None),
    ]
    assert out[12]["delta"]["stop_reason"] == "tool_use"
    assert out[4]["delta"]["signature"] == "msg_1"
    assert out[10]["delta"]["partial_json"] == '{"a": 1}'
    assert out[0]["message"]["policy_version"] == 3


def test_message_events_of_a_failure() -> None:
    req = MessagesRequest(model="m", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    out = _run(MessageEvents(req, _prep(), "msg_1"), BROKEN)
    assert out[-1] == {
        "type": "error",
        "error": {"type": "api_error", "message": "the backend failed"},
    }
