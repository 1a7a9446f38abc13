"""OpenAI chat completions on the wire: `chat.completion.chunk`s and the `chat.completion`.

The stream is a role chunk, then one chunk per delta (the logprobs of the
tokens it carries, if asked for), one per parsed tool call, the finish chunk
and, with `stream_options.include_usage`, a usage chunk with no choices. A
backend failure mid-stream is OpenAI's in-stream error object.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from core.store.models import Completion
from gateway.agent.encoders.openai import OpenAIChunks
from gateway.agent.events import ReasoningDelta, TextDelta, Token, ToolCallDelta
from gateway.protocol import (
    ChatCompletion,
    ChatCompletionRequest,
    Choice,
    ChoiceLogprobs,
    CompletionTokensDetails,
    ResponseMessage,
    TokenLogprob,
    Usage,
)
from inference.reasoning import think_token_count

if TYPE_CHECKING:  # the chat service encodes its answers here
    from gateway.agent.completions import Prepared


class ChatChunks(OpenAIChunks):
    """The chunks of one streamed chat completion."""

    def __init__(
        self, req: ChatCompletionRequest, prep: Prepared, completion_id: str, created: int
    ) -> None:
        super().__init__(req.model, req.stream_options, prep, completion_id, created)
        self.logprobs = bool(req.logprobs)

    def start(self) -> list[dict[str, Any]]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def text(self, delta: TextDelta) -> list[dict[str, Any]]:
        return [self._chunk({"content": delta.text}, logprobs=self._logprobs(delta.tokens))]

    def reasoning(self, delta: ReasoningDelta) -> list[dict[str, Any]]:
        content = {"reasoning_content": delta.text}
        return [self._chunk(content, logprobs=self._logprobs(delta.tokens))]

    def tool_call(self, delta: ToolCallDelta) -> list[dict[str, Any]]:
        return [self._chunk({"tool_calls": [{"index": delta.index, **delta.call}]})]

    def done(self, row: Completion) -> list[dict[str, Any]]:
        usage = chat_usage([row], self.prep.serving.template.decode)
        return self.finished(self._chunk({}, finish_reason(row)), usage, row)

    def _chunk(
        self, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None
    ) -> dict[str, Any]:
        return self.envelope(
            {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "system_fingerprint": self.fingerprint,
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                ],
            }
        )

    def _logprobs(self, tokens: tuple[Token, ...]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        tok = self.prep.serving.template.tokenizer
        return {"content": [{"token": tok.decode([t.id]), "logprob": t.logprob} for t in tokens]}


def chat_completion(
    req: ChatCompletionRequest,
    prep: Prepared,
    base_id: str,
    group_id: str | None,
    rows: list[Completion],
) -> ChatCompletion:
    """The whole answer of a call whose `n` choices are stored as `rows`."""
    tok = prep.serving.template.tokenizer
    choices = []
    for i, row in enumerate(rows):
        logprobs = None
        if req.logprobs:
            logprobs = ChoiceLogprobs(
                content=[
                    TokenLogprob(token=tok.decode([t]), logprob=lp)
                    for t, lp in zip(row.output_token_ids, row.output_logprobs, strict=True)
                ]
            )
        choices.append(
            Choice(
                index=i,
                message=ResponseMessage(
                    content=row.content if (row.content or not row.tool_calls) else None,
                    tool_calls=row.tool_calls,
                    reasoning_content=row.reasoning_content,
                ),
                logprobs=logprobs,
                finish_reason=finish_reason(row),
                completion_id=row.id,
                episode_id=row.episode_id,
                version_starts=row.version_starts,
            )
        )
    return ChatCompletion(
        id=base_id,
        model=req.model,
        choices=choices,
        usage=chat_usage(rows, prep.serving.template.decode),
        system_fingerprint=f"rlgate-{rows[0].run_id}-v{rows[0].policy_version}",
        episode_id=rows[0].episode_id if len(rows) == 1 else None,
        group_id=group_id,
        policy_version=rows[0].policy_version,
        version_starts=rows[0].version_starts,
    )


def chat_usage(rows: list[Completion], decode: Callable[[list[int]], str]) -> Usage:
    """Token counts of a call's choices (they share the prompt); with reasoning parsed, the
    thinking tokens too (`completion_tokens_details.reasoning_tokens`, as OpenAI counts them)."""
    n_prompt = len(rows[0].prompt_token_ids)
    n_out = sum(len(r.output_token_ids) for r in rows)
    thinking = [r for r in rows if r.reasoning_content is not None]
    details = None
    if thinking:
        n_think = sum(think_token_count(list(r.output_token_ids), decode) for r in thinking)
        details = CompletionTokensDetails(reasoning_tokens=n_think)
    return Usage(
        prompt_tokens=n_prompt,
        completion_tokens=n_out,
        total_tokens=n_prompt + n_out,
        completion_tokens_details=details,
    )


def finish_reason(row: Completion) -> str:
    if row.tool_calls:
        return "tool_calls"
    return "length" if row.finish_reason == "length" else "stop"
