"""A bounded cache of rendered prompts: the same messages and tools give the same ids.

Rendering a chat template and tokenizing its text is a pure function of the
messages and the tools (for one tokenizer), and it is the most expensive step
of a chat call (about 1.5 ms for a system prompt, two tools and four messages
on a byte-level tokenizer). What repeats in RL traffic is whole prompts: the
first turn of every member of a GRPO group is the same task, and so is every
retry of a call. Those are served from here, on the event loop, without the
worker-thread hop a render needs. Ids are stored packed (4 bytes a token) and
the cache holds at most `max_bytes` of keys and ids, least recently used out.
"""

from __future__ import annotations

import json
import threading
from array import array
from collections import OrderedDict
from typing import Any


def prompt_key(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str | None:
    """The exact input of a render as one string; None if it is not plain JSON (not cached)."""
    try:
        return json.dumps([messages, tools], ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError):
        return None


class RenderCache:
    """Rendered prompt ids by `prompt_key`, thread-safe (renders run in worker threads)."""

    def __init__(self, max_bytes: int = 32 * 2**20) -> None:
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0  # renders stored (each one a lookup that missed)
        self._entries: OrderedDict[str, array] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: str | None) -> list[int] | None:
        if key is None:
            return None
        with self._lock:
            ids = self._entries.get(key)
            if ids is None:
                return None
            self._entries.move_to_end(key)
            self.hits += 1
        return ids.tolist()

    def put(self, key: str | None, ids: list[int]) -> None:
        if key is None:
            return
        self.misses += 1  # a render that had to happen
        packed = array("i", ids)
        size = len(key) + packed.itemsize * len(packed)
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= len(key) + old.itemsize * len(old)
            self._entries[key] = packed
            self._bytes += size
            while self._bytes > self.max_bytes:
                k, v = self._entries.popitem(last=False)
                self._bytes -= len(k) + v.itemsize * len(v)

    def __len__(self) -> int:
        return len(self._entries)
