"""OpenAI legacy text completions on the wire: `text_completion` chunks and the whole answer.

The stream is the echoed prompt (if asked for), then one chunk per text
delta (its tokens' logprobs with their offsets in the echo plus answer, if
asked for), the finish chunk and, with `stream_options.include_usage`, a
usage chunk with no choices. A backend failure mid-stream is OpenAI's
in-stream error object.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from core.store.models import Completion
from gateway.agent.encoders.openai import OpenAIChunks
from gateway.agent.events import TextDelta, Token
from gateway.agent.streaming import IncrementalDecoder
from gateway.protocol import Usage
from gateway.protocol_legacy import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    TextCompletion,
)
from inference.chat_template import ChatTemplate

if TYPE_CHECKING:
    from gateway.agent.completions import Prepared


class TextChunks(OpenAIChunks):
    """The chunks of one streamed text completion."""

    def __init__(
        self, req: CompletionRequest, prep: Prepared, completion_id: str, created: int
    ) -> None:
        super().__init__(req.model, req.stream_options, prep, completion_id, created)
        self.logprobs = req.logprobs is not None
        self.echo = prompt_text(prep) if req.echo else ""

    def start(self) -> list[dict[str, Any]]:
        if not self.echo:
            return []
        lps = None
        if self.logprobs:
            lps = CompletionLogprobs(tokens=[], token_logprobs=[], text_offset=[])
            add_prompt_logprobs(lps, self.prep.serving.template, self.prep.prompt_ids)
        return [self._chunk(self.echo, lps)]

    def text(self, delta: TextDelta) -> list[dict[str, Any]]:
        return [self._chunk(delta.text, self._logprobs(delta.tokens))]

    def done(self, row: Completion) -> list[dict[str, Any]]:
        return self.finished(self._chunk("", finish=finish_reason(row)), text_usage(row), row)

    def _chunk(
        self, text: str, logprobs: CompletionLogprobs | None = None, finish: str | None = None
    ) -> dict[str, Any]:
        choice = {
            "text": text,
            "index": 0,
            "logprobs": logprobs.model_dump() if logprobs is not None else None,
            "finish_reason": finish,
        }
        return self.envelope(
            {
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [choice],
                "system_fingerprint": self.fingerprint,
            }
        )

    def _logprobs(self, tokens: tuple[Token, ...]) -> CompletionLogprobs | None:
        if not self.logprobs:
            return None
        out = CompletionLogprobs(tokens=[], token_logprobs=[], text_offset=[])
        for t in tokens:
            add_token(out, self.prep.serving.template, t.id, t.logprob, len(self.echo) + t.offset)
        return out


def text_completion(req: CompletionRequest, prep: Prepared, row: Completion) -> TextCompletion:
    """The whole answer of a text completion stored as `row`."""
    template = prep.serving.template
    echo = prompt_text(prep) if req.echo else ""
    logprobs = None
    if req.logprobs is not None:
        logprobs = CompletionLogprobs(tokens=[], token_logprobs=[], text_offset=[])
        if req.echo:
            add_prompt_logprobs(logprobs, template, prep.prompt_ids)
        decoder = IncrementalDecoder(template.decode)
        for token, lp in zip(row.output_token_ids, row.output_logprobs, strict=True):
            add_token(logprobs, template, token, lp, len(echo) + decoder.n_sent)
            decoder.push(token)
    return TextCompletion(
        id=row.id,
        model=req.model,
        choices=[
            CompletionChoice(
                text=echo + row.content,
                index=0,
                logprobs=logprobs,
                finish_reason=finish_reason(row),
            )
        ],
        usage=text_usage(row),
        system_fingerprint=f"rlgate-{row.run_id}-v{row.policy_version}",
        episode_id=row.episode_id,
        policy_version=row.policy_version,
        version_starts=row.version_starts,
    )


def prompt_text(prep: Prepared) -> str:
    """The prompt as stored: the one `prompt` message's text."""
    return str(prep.messages[0]["content"])


def text_usage(row: Completion) -> Usage:
    n_prompt, n_out = len(row.prompt_token_ids), len(row.output_token_ids)
    return Usage(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out)


def finish_reason(row: Completion) -> str:
    return "length" if row.finish_reason == "length" else "stop"


def add_token(
    out: CompletionLogprobs, template: ChatTemplate, token: int, lp: float | None, offset: int
) -> None:
    out.tokens.append(str(template.tokenizer.decode([token])))
    out.token_logprobs.append(lp)
    out.text_offset.append(offset)


def add_prompt_logprobs(out: CompletionLogprobs, template: ChatTemplate, ids: list[int]) -> None:
    """Echoed prompt tokens: their strings and offsets, with null logprobs (never scored)."""
    decoder = IncrementalDecoder(template.template_text)
    for token in ids:
        add_token(out, template, token, None, decoder.n_sent)
        decoder.push(token)
