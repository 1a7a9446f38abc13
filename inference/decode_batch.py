"""The rows the local backend is decoding, and their one KV cache.

Continuous batching keeps one KV cache for every row still generating: a
row's keys and values sit in the columns its attention mask marks (1), in
order, padding (0) elsewhere; the positions fed to the model count a row's
own tokens only, so padding changes nothing it computes. Rows that join are
prefilled together and their cache is padded on the left to the batch's
width (or the batch to theirs); a row that finishes leaves at once with its
cache row, and columns that no row uses any more are cut from the left.
Each decode step then feeds every row its last sampled token at its own
position, so rows of any age decode together and no step is spent on a
finished row.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from inference.lora import Adapter
from inference.stop_strings import TextStop
from inference.types import FinishReason, GenerateRequest, GenerateResult, result_with_marks


@dataclass
class Job:
    request: GenerateRequest
    future: Future
    on_token: Callable[[int, float], None] | None = None  # called from the model thread
    cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def need(self) -> int:
        """Cache positions this request may occupy: its prompt and every token it may sample."""
        return len(self.request.prompt_token_ids) + self.request.params.max_tokens


@dataclass
class Row:
    """One request being decoded."""

    job: Job
    adapter: Adapter | None  # None: the base model; fixed when the row joins (or a keep swap)
    version: int  # the version that sampled its first token
    generator: torch.Generator | None
    stop: TextStop | None
    marks: list[tuple[int, int]] = field(default_factory=list)  # (token index, version)
    out_ids: list[int] = field(default_factory=list)
    out_lps: list[float] = field(default_factory=list)
    finish: FinishReason | None = None

    def __post_init__(self) -> None:
        self.marks = [(0, self.version)]

    @property
    def prompt(self) -> list[int]:
        return self.job.request.prompt_token_ids

    @property
    def kv_len(self) -> int:
        """Positions in the cache: the prompt and every sampled token but the last, which
        the next step feeds."""
        return len(self.prompt) + len(self.out_ids) - 1

    def take(self, token: int, logprob: float) -> None:
        """Record a sampled token, tell the stream, and decide whether the row ends."""
        params = self.job.request.params
        self.out_ids.append(token)
        self.out_lps.append(logprob)
        if self.job.on_token is not None:
            self.job.on_token(token, logprob)
        hit = self.stop is not None and self.stop.push(token)
        if token in params.stop_token_ids or hit:
            self.finish = "stop"
        elif len(self.out_ids) >= params.max_tokens:
            self.finish = "length"

    def mark(self, version: int) -> bool:
        """Row's next token is sampled by `version`; False if that would go back in time."""
        last = self.marks[-1][1]
        if version > last:
            self.marks.append((len(self.out_ids), version))
        return version >= last

    def result(self) -> GenerateResult:
        return result_with_marks(self.out_ids, self.out_lps, self.finish or "length", self.marks)


class DecodeBatch:
    """Rows decoding together: their order is the batch order of `cache` and `mask`."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.cache: Any = None  # a transformers DynamicCache, [rows, heads, width, head_dim]
        self.mask: torch.Tensor | None = None  # [rows, width], 1 where a row has a position

    @property
    def width(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[1])

    def join(self, rows: list[Row], cache: Any, mask: torch.Tensor) -> None:
        """Add `rows` with their cache (same row order) and its mask; pads the narrower
        side on the left."""
        if self.cache is None:
            self.rows, self.cache, self.mask = list(rows), cache, mask
            return
        assert self.mask is not None
        width = max(self.width, int(mask.shape[1]))
        for own, new in zip(self.cache.layers, cache.layers, strict=True):
            own.keys = torch.cat([_pad_left(own.keys, width), _pad_left(new.keys, width)])
            own.values = torch.cat([_pad_left(own.values, width), _pad_left(new.values, width)])
        self.mask = torch.cat([_pad_left(self.mask, width), _pad_left(mask, width)])
        self.rows.extend(rows)

    def leave(self, done: list[int]) -> None:
        """Drop rows `done` (indexes) with their cache rows, then the columns nobody uses."""
        if not done:
            return
        keep = [i for i in range(len(self.rows)) if i not in set(done)]
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache = self.mask = None
            return
        assert self.mask is not None
        index = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        first = int(mask.any(0).to(torch.int8).argmax())  # the first column a row still uses
        self.mask = mask[:, first:]
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, first:]
            layer.values = layer.values.index_select(0, index)[:, :, first:]

    def grow(self) -> torch.Tensor:
        """The mask for a step that feeds one more position to every row."""
        assert self.mask is not None
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        return self.mask

    def overwrite(self, row: int, cache: Any) -> None:
        """Replace row `row`'s positions with those of `cache` (one row, `kv_len` wide)."""
        assert self.mask is not None
        cols = self.mask[row].nonzero()[:, 0]
        for own, new in zip(self.cache.layers, cache.layers, strict=True):
            own.keys[row, :, cols] = new.keys[0]
            own.values[row, :, cols] = new.values[0]


class GrowingLayer(DynamicLayer):
    """A transformers cache layer that appends a step's keys and values in place, into
    spare columns, instead of concatenating: a step copies its own new column, not the
    whole cache (at 32 rows and 500 positions that copy was 2 x 12 MB per layer per step).

    `keys` and `values` are views of the buffers. Whoever assigns them other tensors
    (`DecodeBatch.join`, `leave`) makes the next `update` copy them into fresh buffers
    with room to grow, once.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys, self.values
        assert keys is not None and values is not None
        n, add = keys.shape[-2], key_states.shape[-2]
        k, v = self._k, self._v
        if (
            k is None
            or v is None
            or keys.data_ptr() != k.data_ptr()
            or keys.shape[:2] != k.shape[:2]
            or n + add > k.shape[-2]
        ):
            room = n + add + max(64, (n + add) // 4)
            shape = (*keys.shape[:2], room, keys.shape[-1])
            k, v = keys.new_empty(shape), values.new_empty(shape)
            k[:, :, :n] = keys
            v[:, :, :n] = values
            self._k, self._v = k, v
        k[:, :, n : n + add] = key_states
        v[:, :, n : n + add] = value_states
        grown_k, grown_v = k[:, :, : n + add], v[:, :, : n + add]
        self.keys, self.values = grown_k, grown_v
        return grown_k, grown_v


def growing(cache: Any) -> Any:
    """`cache` (a DynamicCache just computed) with `GrowingLayer`s holding its tensors."""
    cache.layers = [GrowingLayer(layer.keys, layer.values) for layer in cache.layers]
    return cache


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    """`t` ([rows, width'] or [rows, heads, width', dim]) with zeros before it to `width`."""
    dim = 1 if t.dim() == 2 else 2
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)
