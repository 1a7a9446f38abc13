"""The KV cache of prompts the local backend prefilled, kept for later rows that share
a prefix with them.

A row's keys and values at positions 0..k-1 depend only on its first k tokens
and on the weights that computed them (attention is causal and positions
start at 0 in every row). So a new prompt may reuse the first k positions of
any stored prompt it shares its first k tokens with, provided the same
weights computed them: entries are keyed by the weights (`PrefixKey`: the
adapter's name and version and the base version), and a lookup only
considers entries of its own key. A GRPO group, `n > 1`, a system prompt and
tool list common to many agents, and the earlier turns of an episode all
prefill their shared part once.

Size: at most `max_bytes` of keys and values; the least recently used entry
goes first. A swap of the base weights drops every entry, a swap of one
adapter drops that adapter's entries (`drop`); an entry whose key no row asks
for any more also ages out by itself. Used by the model thread only.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

# (adapter name or None, adapter version or None, base version): the weights of an entry
PrefixKey = tuple[str | None, int | None, int]
KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values, each [1, H, n, D]

MIN_REUSE = 8  # a shorter shared prefix is cheaper to prefill again than to copy


@dataclass
class _Entry:
    key: PrefixKey
    ids: torch.Tensor  # [n] token ids
    kv: KV
    nbytes: int


class PrefixCache:
    """Prefilled prompts by weights key, least recently used first out past `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.hits = 0  # rows that reused a prefix
        self.reused_tokens = 0  # prompt tokens they did not prefill
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, key: PrefixKey, prompt: list[int]) -> tuple[int, KV | None]:
        """The longest stored prefix of `prompt` computed by `key`'s weights, at most all but
        its last token (whose logits the caller needs): (its length, its KV), or (0, None)."""
        limit = len(prompt) - 1
        if limit < MIN_REUSE or not self._entries:
            return 0, None
        ids = torch.tensor(prompt[:limit], dtype=torch.long)
        best, found = 0, None
        for handle, entry in self._entries.items():
            if entry.key != key:
                continue
            n = min(limit, entry.ids.numel())
            same = entry.ids[:n] == ids[:n]
            shared = n if bool(same.all()) else int(same.to(torch.int8).argmin())
            if shared > best:
                best, found = shared, handle
        if found is None or best < MIN_REUSE:
            return 0, None
        self._entries.move_to_end(found)
        self.hits += 1
        self.reused_tokens += best
        kv = self._entries[found].kv
        return best, [(k[:, :, :best], v[:, :, :best]) for k, v in kv]

    def store(self, key: PrefixKey, prompt: list[int], kv: KV) -> None:
        """Keep `kv` (one row's keys and values for `prompt`, copied here) unless an entry of
        the same weights already holds the whole prompt; evict past the size limit."""
        ids = torch.tensor(prompt, dtype=torch.long)
        for handle, entry in self._entries.items():
            n = ids.numel()
            if entry.key == key and entry.ids.numel() >= n and bool((entry.ids[:n] == ids).all()):
                self._entries.move_to_end(handle)
                return
        nbytes = sum(k.numel() * k.element_size() * 2 for k, _ in kv)
        if nbytes > self.max_bytes:
            return
        copy = [(k.clone(), v.clone()) for k, v in kv]
        self._entries[self._next] = _Entry(key, ids, copy, nbytes)
        self._next += 1
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes

    def drop(self, adapter: str | None = None, *, everything: bool = False) -> None:
        """Forget the entries of adapter `adapter` (its weights changed), or every entry (the
        base weights changed)."""
        for handle in [h for h, e in self._entries.items() if everything or (e.key[0] == adapter)]:
            self.nbytes -= self._entries.pop(handle).nbytes
