"""Reasoning parsers: split a model's thinking from its answer, whole or as it streams.

A thinking model answers `<think>reasoning</think>answer`. Templates of the
Qwen3 and DeepSeek-R1 kind open the block in the generation prompt itself
(`...<|im_start|>assistant\n<think>\n`), so what is sampled starts inside it:
`reasoning</think>answer`. `opens_think` tells the two apart from the
rendered prompt; every function here takes that as `opened`. A block that
never closes (max_tokens hit mid-thought) is all reasoning, with an empty
answer. Only the presentation changes: the sampled ids, thinking included,
are what is stored and trained on.
"""

from __future__ import annotations

from collections.abc import Callable

OPEN, CLOSE = "<think>", "</think>"


def opens_think(prompt_text: str) -> bool:
    """Whether the rendered prompt ends inside an open `<think>` (sampling starts in it)."""
    return prompt_text.rstrip().endswith(OPEN)


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str]:
    """(reasoning, answer) of a sampled text; (None, text) when it does not think.

    The reasoning is stripped of surrounding whitespace and the answer of
    leading whitespace, as `ThinkStream` streams them.
    """
    if not opened:
        body = text.lstrip()
        if not body.startswith(OPEN):
            return None, text
        text = body[len(OPEN) :]
    end = text.find(CLOSE)
    if end < 0:
        return text.strip(), ""
    return text[:end].strip(), text[end + len(CLOSE) :].lstrip()


class ThinkStream:
    """`split_reasoning` for text that arrives in pieces: (reasoning, content) deltas.

    Joined, the deltas of `push` and `flush` are exactly what `split_reasoning`
    returns for the whole text (None reads as ""). Held back meanwhile: a
    start that could still become `<think>`, a tail that could be the start of
    `</think>`, and whitespace that stripping could drop.
    """

    def __init__(self, opened: bool = False) -> None:
        self.mode = "think" if opened else "start"  # start | think | answer | plain
        self.held = ""
        self.reasoning_sent = False
        self.content_sent = False

    def push(self, piece: str) -> tuple[str, str]:
        self.held += piece
        return self._drain(final=False)

    def flush(self) -> tuple[str, str]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning = ""
        if self.mode == "start":
            body = self.held.lstrip()
            if body.startswith(OPEN):
                self.mode, self.held = "think", body[len(OPEN) :]
            elif OPEN.startswith(body) and not final:
                return "", ""
            else:
                self.mode = "plain"
        if self.mode == "think":
            if not self.reasoning_sent:
                self.held = self.held.lstrip()
            end = self.held.find(CLOSE)
            if end >= 0:
                reasoning = self.held[:end].rstrip()
                self.mode, self.held = "answer", self.held[end + len(CLOSE) :]
            elif final:
                reasoning, self.held = self.held.rstrip(), ""
            else:
                keep = len(self.held) - _partial_suffix(self.held, CLOSE)
                reasoning = self.held[:keep].rstrip()
                self.held = self.held[len(reasoning) :]
            self.reasoning_sent = self.reasoning_sent or bool(reasoning)
        if self.mode == "answer" and not self.content_sent:
            self.held = self.held.lstrip()
        content = ""
        if self.mode in ("answer", "plain"):
            content, self.held = self.held, ""
            self.content_sent = self.content_sent or bool(content)
        return reasoning, content


def think_token_count(output_ids: list[int], decode: Callable[[list[int]], str]) -> int:
    """How many of `output_ids` think: up to the one that completes `</think>`, else all.

    For an answer that has reasoning (`split_reasoning` found some). A binary
    search over decoded prefixes, so a `</think>` spelled in several tokens
    is found as surely as a single added token.
    """
    if CLOSE not in decode(output_ids):
        return len(output_ids)
    lo, hi = 1, len(output_ids)  # the smallest prefix whose text holds `</think>`
    while lo < hi:
        mid = (lo + hi) // 2
        if CLOSE in decode(output_ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    return max((k for k in range(1, len(tag)) if text.endswith(tag[:k])), default=0)
