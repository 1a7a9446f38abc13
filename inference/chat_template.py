"""Render chat messages to prompt token ids with the model's own template."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

from inference.render_cache import RenderCache, prompt_key


class ChatTemplate:
    """Wraps a Hugging Face tokenizer: messages -> ids, ids -> text, stop tokens."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if not self.tokenizer.chat_template:
            raise ValueError(f"{model_dir} has no chat template")
        stop = {self.tokenizer.eos_token_id}
        im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != self.tokenizer.unk_token_id:
            stop.add(im_end)
        self.stop_token_ids: tuple[int, ...] = tuple(sorted(t for t in stop if t is not None))
        # Templates that render `tools` themselves (Qwen, Hermes); others get a Hermes prompt.
        self.native_tools = "tools" in self.tokenizer.chat_template
        # Whole prompts seen before (a group's first turns); not for a template that reads
        # the clock (Llama 3's `strftime_now`): its text changes with the date.
        clock = "strftime_now" in self.tokenizer.chat_template
        self.cache = RenderCache(max_bytes=0 if clock else 32 * 2**20)
        self._decode_ids = ids_decoder(self.tokenizer)

    def render_text(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        """The template's text for `messages`, ending with the assistant generation prompt."""
        text = self.tokenizer.apply_chat_template(
            messages, tools=cast(Any, tools), add_generation_prompt=True, tokenize=False
        )
        assert isinstance(text, str)  # tokenize=False gives the text
        return text

    def encode(self, text: str) -> list[int]:
        """Ids of template text (special tokens in it are parsed; none are added)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Prompt ids for `messages`, ending with the assistant generation prompt."""
        key = prompt_key(messages, tools)
        ids = self.cache.get(key)
        if ids is None:
            ids = self.encode(self.render_text(messages, tools))
            self.cache.put(key, ids)
        return ids

    def lookup(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int] | None:
        """`render`'s ids if these exact messages and tools were rendered before, else None:
        cheap enough for the event loop, where a render needs a worker thread."""
        return self.cache.get(prompt_key(messages, tools))

    def continue_from(
        self,
        sampled_ids: list[int],
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        answers: Sequence[tuple[int, int]] = (),
    ) -> tuple[list[int], bool]:
        """Prompt ids for `messages` that reuse `sampled_ids` (an earlier turn's prompt + output).

        `answers` are the [start, end) spans of `sampled_ids` that the model
        sampled, one per assistant message of `messages` that rlgate produced
        (whose content is `decode` of that span, as the agent received it);
        ids outside them were encoded from template text and read back as it.
        If the template renders the history exactly as the model saw and
        sampled it, the result is `sampled_ids` followed by the ids of the
        newly rendered text, and the second value is True (spliced). If the
        template renders it differently (for example by stripping earlier
        `<think>` blocks), nothing is pretended: the whole prompt is rendered
        afresh and the second value is False (drift).
        """
        seen = self.stream_text(sampled_ids, answers)
        full = self.render_text(messages, tools)
        if full.startswith(seen):
            return list(sampled_ids) + self.encode(full[len(seen) :]), True
        return self.encode(full), False

    def stream_text(self, ids: list[int], answers: Sequence[tuple[int, int]] = ()) -> str:
        """The rendered text that `ids` stand for, each span in `answers` read as `answer_text`.

        Sampled ids need not survive a trip through text: a byte token cut
        from its character (an emoji cut by max_tokens), invalid UTF-8, a NUL
        or a special token sampled mid-answer decode to text that re-encodes
        to other ids, and decoded together with their neighbours they may not
        even read as the content the agent received. So a sampled span is
        never decoded with the template text around it; it stands for the
        answer's content, which is what the agent echoes and the template
        renders. The ids of the span are what a splice keeps.
        """
        parts, at = [], 0
        for start, end in sorted(answers):
            parts += [self.template_text(ids[at:start]), self.answer_text(ids[start:end])]
            at = end
        parts.append(self.template_text(ids[at:]))
        return "".join(parts)

    def answer_text(self, output_ids: list[int]) -> str:
        """A sampled answer as rendered history holds it: its content, then its stop token."""
        if output_ids and output_ids[-1] in self.stop_token_ids:
            return self.decode(output_ids[:-1]) + self.template_text(output_ids[-1:])
        return self.decode(output_ids)

    def template_text(self, ids: list[int]) -> str:
        """Ids as the text they spell, special tokens included (template ids were encoded
        from text; a token-id prompt is stored as this text)."""
        return self._decode_ids(ids, False)

    def decode(self, token_ids: list[int]) -> str:
        """Text of sampled ids, without special tokens (the stop token is not content)."""
        text = self._decode_ids(token_ids, True)
        # NUL cannot be stored in PostgreSQL text; the token ids keep the exact sample.
        return text.replace("\x00", "\ufffd")


def ids_decoder(tokenizer: Any) -> Callable[[list[int], bool], str]:
    """`decode(ids, skip_special_tokens)` for `tokenizer`, never cleaning up spaces.

    A fast tokenizer's own (Rust) decode when it has one: transformers' `decode`
    converts and checks its arguments around that same call, a cost on the event
    loop for every answer stored, and without clean-up the text is the same
    (tests/unit/test_incremental_decoder.py).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.decode

    def decode(ids: list[int], skip_special_tokens: bool) -> str:
        return tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    return decode
