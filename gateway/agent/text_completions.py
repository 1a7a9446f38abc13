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

from fastapi.responses import StreamingResponse

from core.store.models import Run
from gateway.agent.completions import ChatService, Prepared, sampling_params
from gateway.agent.encoders.text import TextChunks, text_completion
from gateway.agent.episodes import EpisodeRef, explicit_ids
from gateway.agent.events import encoded
from gateway.agent.sse import event_stream, sse
from gateway.agent.streaming import SampleStream
from gateway.errors import InvalidRequest
from gateway.protocol_legacy import DEFAULT_MAX_TOKENS, CompletionRequest, TextCompletion

logger = logging.getLogger(__name__)

PROMPT_ROLE = "prompt"


class TextCompletionService:
    """Prepares text completions; they sample and store through the chat service's core."""

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
        serving = await self.chat.serving(run, ref)
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
            req,
            n_prompt=len(prompt_ids),
            max_new=req.max_tokens or DEFAULT_MAX_TOKENS,
            max_context=serving.max_context,
            stop_token_ids=template.stop_token_ids,
            stop=(req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()),
            param="prompt",
        )
        messages = [{"role": PROMPT_ROLE, "content": text}]
        cfg = self.chat.config(run)
        placement = await self.chat.place(run, cfg, ref, req.metadata, messages)
        await self.chat.admit(run, cfg, placement)
        return Prepared(run, serving, messages, placement, prompt_ids, False, params)

    async def create(self, run: Run, req: CompletionRequest, ref: EpisodeRef) -> TextCompletion:
        prep = await self.prepare(run, req, ref)
        rows, _ = await self.chat.sample(prep, new_id())
        return text_completion(req, prep, rows[0])

    async def start_stream(
        self, run: Run, req: CompletionRequest, ref: EpisodeRef
    ) -> StreamingResponse:
        """Every client error, and a backend full or down, is raised before the first chunk."""
        prep = await self.prepare(run, req, ref)
        stream = SampleStream(self.chat, prep, new_id())
        await stream.open()
        chunks = TextChunks(req, prep, stream.id, stream.created)
        return event_stream(sse(encoded(stream.events(), chunks)), stream.episode_id)


def new_id() -> str:
    return "cmpl-" + uuid.uuid4().hex
