"""Reasoning parsers: split a model's thinking from its answer."""

from __future__ import annotations

import re

_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, answer) for text that opens with `<think>...</think>`; else (None, text).

    Only the presentation changes: the sampled ids, thinking included, are
    what is stored and trained on.
    """
    m = _THINK.match(text)
    if m is None:
        return None, text
    return m.group(1).strip(), text[m.end() :]
