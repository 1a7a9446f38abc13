"""Render chat messages to prompt token ids with the model's own template."""

from __future__ import annotations

from pathlib import Path
from typing import Any


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

    def render(self, messages: list[dict[str, Any]]) -> list[int]:
        """Prompt ids for `messages`, ending with the assistant generation prompt."""
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids)

    def decode(self, token_ids: list[int]) -> str:
        """Text of sampled ids, without special tokens (the stop token is not content)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
