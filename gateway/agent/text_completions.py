"""Legacy text completions: the prompt as given (no chat template), captured like chat turns.

A text completion is stored as a `Completion` row like any chat turn, so
rewards, export and training treat it the same. Its `messages` are
`[{"role": "prompt", "content": <prompt text>}]`: no chat role fits a raw
prompt, and the role "prompt" can never prefix-match a chat call. A prompt
given as token ids is sent as is; its stored text is those ids decoded with
special tokens kept. The ids the model saw are always `prompt_token_ids`.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from core.store.models import Completion, Run
from gateway.agent.completions import ChatService, Prepared, sampling_params
from gateway.agent.episodes import EpisodeRef, explicit_ids, place
from gateway.agent.streaming import BackendStream, IncrementalDecoder
from gateway.errors import InvalidRequest, backend_failure
from gateway.protocol import Usage
from gateway.protocol_legacy import (
    DEFAULT_MAX_TOKENS,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    TextCompletion,
)
from inference.backend import BackendError
from inference.chat_template import ChatTemplate
from inference.types import GenerateRequest

logger = logging.getLogger(__name__)

PROMPT_ROLE = "prompt"


class TextCompletionService:
    """Prepares, samples and stores text completions through the chat service's storage."""

    def __init__(self, chat: ChatService) -> None:
        self.chat = chat

    async def prepare(self, run: Run, req: CompletionRequest, ref: EpisodeRef) -> Prepared:
        """The prompt ids, placement and sampling params; every client error is raised here."""
        try:
            prompt = req.prompt_input()
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="prompt") from exc
        if (req.n or 1) > 1 or (req.best_of or 1) > 1:
            raise InvalidRequest(
                "n > 1 (and best_of > 1) is not supported on /v1/completions; "
                "send n requests that share a group id instead",
                param="n" if (req.n or 1) > 1 else "best_of",
            )
        if req.suffix:
            raise InvalidRequest("suffix (insertion) is not supported", param="suffix")
        explicit_ids(ref, req.metadata)  # validate ids before any work
        serving = await self.chat.serving(run)
        template = serving.template
        if isinstance(prompt, str):
            prompt_ids = await asyncio.to_thread(template.encode, prompt)
            text = prompt
        else:
            vocab = len(template.tokenizer)
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequest(
                    f"token id {bad} is outside the vocabulary (0 to {vocab - 1})", param="prompt"
                )
            prompt_ids, text = prompt, template.template_text(prompt)
        if not prompt_ids:
            raise InvalidRequest("prompt is empty: it encodes to no tokens", param="prompt")
        # No chat template, but the template's end tokens still end a ChatML turn.
        params = sampling_params(
            n_prompt=len(prompt_ids),
            max_new=req.max_tokens or DEFAULT_MAX_TOKENS,
            max_context=serving.max_context,
            temperature=req.temperature,
            top_p=req.top_p,
            seed=req.seed,
            stop_token_ids=template.stop_token_ids,
            stop=(req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()),
            param="prompt",
        )
        messages = [{"role": PROMPT_ROLE, "content": text}]
        cfg = self.chat.config(run)
        placement = await place(
            self.chat.lineage, run.id, ref, req.metadata, messages, cfg.prefix_match_window_s
        )
        await self.chat.admit(run, cfg, placement)
        # `Prepared.req` is read only by chat streaming, which text completions do not use.
        return Prepared(run, req, serving, messages, placement, prompt_ids, False, params)  # type: ignore[arg-type]

    async def create(self, run: Run, req: CompletionRequest, ref: EpisodeRef) -> TextCompletion:
        prep = await self.prepare(run, req, ref)
        try:
            result = await prep.serving.backend.generate(
                GenerateRequest(prep.prompt_ids, prep.params, prep.placement.episode_id)
            )
        except BackendError as exc:
            logger.warning("backend failed for run %s: %s", run.id, exc)
            raise backend_failure(exc) from exc
        row = ChatService.completion_row(prep, new_id(), None, result)
        await self.chat.store([row], prep.placement.group_id)
        return self._response(prep, row)

    def stream(self, prep: Prepared) -> TextStream:
        return TextStream(self.chat, prep)

    @staticmethod
    def _response(prep: Prepared, row: Completion) -> TextCompletion:
        req: CompletionRequest = prep.req  # type: ignore[assignment]
        echo = prep.messages[0]["content"] if req.echo else ""
        logprobs = None
        if req.logprobs is not None:
            logprobs = CompletionLogprobs(tokens=[], token_logprobs=[], text_offset=[])
            if req.echo:
                add_prompt_logprobs(logprobs, prep.serving.template, prep.prompt_ids)
            decoder = IncrementalDecoder(prep.serving.template.decode)
            for token, lp in zip(row.output_token_ids, row.output_logprobs, strict=True):
                add_token(logprobs, prep.serving.template, token, lp, len(echo) + decoder.n_sent)
                decoder.push(token)
        n_prompt, n_out = len(row.prompt_token_ids), len(row.output_token_ids)
        return TextCompletion(
            id=row.id,
            model=req.model,
            choices=[
                CompletionChoice(
                    text=echo + row.content,
                    index=0,
                    logprobs=logprobs,
                    finish_reason=finish_reason(row.finish_reason),
                )
            ],
            usage=Usage(
                prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out
            ),
            system_fingerprint=f"rlgate-{row.run_id}-v{row.policy_version}",
            episode_id=row.episode_id,
            policy_version=row.policy_version,
        )


class TextStream(BackendStream):
    """One streaming text completion: `chunks()` yields JSON-ready `text_completion` dicts.

    Same ordering as chat streaming (`gateway.agent.streaming`): the echoed
    prompt (if asked for) goes first, then text as it is sampled; the completion
    is STORED before the finish chunk; a disconnect cancels generation and
    stores the partial sample with finish_reason "cancelled".
    """

    def __init__(self, chat: ChatService, prep: Prepared) -> None:
        super().__init__(chat, prep, new_id())
        self.req: CompletionRequest = prep.req  # type: ignore[assignment]

    def _chunk(self, text: str, logprobs: CompletionLogprobs | None = None, finish=None) -> dict:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.req.model,
            "choices": [
                {
                    "text": text,
                    "index": 0,
                    "logprobs": logprobs.model_dump() if logprobs is not None else None,
                    "finish_reason": finish,
                }
            ],
            "system_fingerprint": f"rlgate-{self.prep.run.id}-v{self.prep.serving.backend.version}",
            # --- rlgate extension: the episode this call is filed under
            "episode_id": self.prep.placement.episode_id,
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _logprobs(self, pending: list[tuple[int, float, int]]) -> CompletionLogprobs | None:
        if self.req.logprobs is None:
            return None
        out = CompletionLogprobs(tokens=[], token_logprobs=[], text_offset=[])
        for token, lp, offset in pending:
            add_token(out, self.prep.serving.template, token, lp, offset)
        return out

    async def _chunks(self) -> AsyncIterator[dict[str, Any]]:
        template = self.prep.serving.template
        decoder = IncrementalDecoder(template.decode, self.prep.params.stop)
        echo = self.prep.messages[0]["content"] if self.req.echo else ""
        if echo:
            lps = None
            if self.req.logprobs is not None:
                lps = CompletionLogprobs(tokens=[], token_logprobs=[], text_offset=[])
                add_prompt_logprobs(lps, template, self.prep.prompt_ids)
            yield self._chunk(echo, lps)
        pending: list[tuple[int, float, int]] = []
        async for token, logprob in self.tokens():
            pending.append((token, logprob, len(echo) + decoder.n_sent))
            piece = decoder.push(token)
            if piece:
                yield self._chunk(piece, self._logprobs(pending))
                pending = []
        result = await self.stream.result()
        rest = decoder.flush()
        if rest or pending:
            yield self._chunk(rest, self._logprobs(pending))
        await self._store(result)
        yield self._chunk("", finish=finish_reason(result.finish_reason))
        if self.include_usage:
            yield self.usage_chunk(self._chunk(""), result)


def new_id() -> str:
    return "cmpl-" + uuid.uuid4().hex


def finish_reason(sampled: str) -> str:
    return "length" if sampled == "length" else "stop"


def add_token(out: CompletionLogprobs, template: ChatTemplate, token: int, lp, offset: int) -> None:
    out.tokens.append(template.tokenizer.decode([token]))
    out.token_logprobs.append(lp)
    out.text_offset.append(offset)


def add_prompt_logprobs(out: CompletionLogprobs, template: ChatTemplate, ids: list[int]) -> None:
    """Echoed prompt tokens: their strings and offsets, with null logprobs (never scored)."""
    decoder = IncrementalDecoder(template.template_text)
    for token in ids:
        add_token(out, template, token, None, decoder.n_sent)
        decoder.push(token)
