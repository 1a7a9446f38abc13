"""Sequence packing: several samples in one row, with attention kept inside each sample.

A packed micro-batch is ONE row of concatenated ids (batch dimension 1, no
padding). Two things keep the samples independent, exactly as if each had
its own padded row:

- `position_ids` restart at 0 at every sample start, so rotary embeddings
  see the same positions as in a padded batch;
- a 4D block-diagonal causal mask `[1, 1, T, T]` (float: 0 where a query
  may attend, -inf elsewhere) stops attention at sample boundaries.

transformers 5.x hands a 4D `attention_mask` to the attention function
untouched (`masking_utils._preprocess_mask_arguments` returns early on
`ndim == 4`), and both the `eager` (adds it to the scores) and `sdpa`
(passes it as `attn_mask`) implementations accept an additive float mask of
the compute dtype. The mask costs T*T elements and the attention still does
T*T work (the -inf blocks are computed, then discarded), so packing wins
when the MLP and the LM head dominate, not at very long budgets. On GPU,
flash-attention's varlen kernels (`attn_implementation="flash_attention_2"`
with `position_ids` restarts and no mask) skip the off-diagonal blocks; that
path is GPU-only and is not used here.

The position before a sample's first token belongs to the previous sample,
so a sample's first token is never trained (its loss-mask entry is zeroed;
it is a prompt token in every sample the gateway builds). The padded path
zeroes the same column, see `trainable_batch`.

**Shared prefixes.** The samples of a GRPO group share their prompt, and
an agent's prompts share a system prompt and tool list; the prompt is most
of every sequence. `pack` stores a prefix once: a sample whose first `n`
ids equal those of a sample already in the row becomes a *branch* segment
that holds only its ids from `n - 1` on and attends to the untouched prefix
through the mask. Its first id is a copy of id `n - 1` at the same position
with the same context, so its hidden state is the one the shared row
computes there and it predicts id `n` exactly as a padded row would. The
branch's own ids up to `n - 1` are never trained, so nothing it trains is
lost: sharing stops at a sample's first trained id. Branches may nest (a
group's prompt branching off a system prompt another group also used); a
position sees its own segment causally and, in each ancestor segment, the
ids before the point where its path leaves that ancestor. Logprobs, loss
and gradient equal the unshared row's (tested); only the work shrinks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainer.batch import Batch, Sample, collate


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [1, T] the samples back to back
    position_ids: torch.Tensor  # [1, T] restarting at 0 for each sample
    attention_mask: torch.Tensor  # [1, 1, T, T] block-diagonal causal, 0 / -inf
    loss_mask: torch.Tensor  # [1, T] 1 on trained tokens, 0 at every sample start
    temperatures: torch.Tensor  # [1, T]
    seq_lens: list[int]  # ids each segment holds (a whole sample unless it branches)
    padded: Batch  # the same samples right-padded [S, L]: old logprobs, advantages, loss mask
    scatter_index: torch.Tensor  # [T] flat index into [S * L] of each packed position

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """[1, T] packed values -> [S, L] in the padded layout (0 on padding), differentiable."""
        s, width = self.padded.input_ids.shape
        flat = values.new_zeros(s * width)
        flat = flat.index_put((self.scatter_index.to(values.device),), values[0])
        return flat.view(s, width)


def trainable_batch(batch: Batch) -> Batch:
    """Zero the loss mask at position 0: no hidden state predicts a sequence's first token."""
    batch.loss_mask[:, 0] = 0.0
    return batch


def block_causal_mask(seq_lens: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[1, 1, T, T] additive mask: position q may see k iff k <= q and both are in one sample."""
    whole = [Segment(i, 0, None) for i in range(len(seq_lens))]
    return _additive(_segment_allowed(whole, seq_lens), dtype)


@dataclass(frozen=True)
class Segment:
    """The part of one sample that a packed row holds.

    `start` is the sample index of its first id; `parent` the segment (by
    index) whose ids before `start` it shares, None for a whole sample.
    """

    sample: int
    start: int
    parent: int | None


def _first_trained(s: Sample) -> int:
    return next((i for i, m in enumerate(s.loss_mask) if m), len(s.input_ids))


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if n >= limit or x != y:
            break
        n += 1
    return n


def plan_segments(samples: Sequence[Sample], *, share_prefix: bool = True) -> list[Segment]:
    """One segment per sample; with `share_prefix`, a branch off the longest shared prefix.

    A sample shares at most up to its first trained id, and only when that
    saves at least one id (a common prefix of two or more).
    """
    segments: list[Segment] = []
    for i, s in enumerate(samples):
        best, shared = None, 0
        if share_prefix:
            limit = _first_trained(s)
            for j, seg in enumerate(segments):
                n = _common_prefix(samples[seg.sample].input_ids, s.input_ids, limit)
                if n > shared:
                    best, shared = j, n
        if best is None or shared < 2:
            segments.append(Segment(i, 0, None))
            continue
        # the branch copies id shared-1; the segment that holds it (or an ancestor) is the parent
        while segments[best].start > shared - 1:
            parent = segments[best].parent
            assert parent is not None  # a segment that starts past 0 branches off a parent
            best = parent
        segments.append(Segment(i, shared - 1, best))
    return segments


def packed_length(samples: Sequence[Sample], *, share_prefix: bool = True) -> int:
    """How many ids `pack` puts in the row for `samples` (its mask is that squared)."""
    segments = plan_segments(samples, share_prefix=share_prefix)
    return sum(len(samples[seg.sample].input_ids) - seg.start for seg in segments)


def _segment_allowed(segments: Sequence[Segment], lens: Sequence[int]) -> torch.Tensor:
    """[T, T] bool: causal inside a segment, plus each ancestor's ids before the path's cut."""
    lens_t = torch.tensor(list(lens), dtype=torch.long)
    seg_id = torch.repeat_interleave(torch.arange(len(lens_t)), lens_t)
    idx = torch.arange(len(seg_id))
    allowed = (seg_id[:, None] == seg_id[None, :]) & (idx[:, None] >= idx[None, :])
    offsets = [0, *torch.cumsum(lens_t, 0).tolist()]
    for q, seg in enumerate(segments):
        cut, node = seg.start, seg.parent
        while node is not None:
            # the ancestor holds sample ids start.. in order: the first `cut - start` are visible
            parent = segments[node]
            visible = cut - parent.start
            allowed[offsets[q] : offsets[q + 1], offsets[node] : offsets[node] + visible] = True
            cut, node = parent.start, parent.parent
    return allowed


def _additive(allowed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # -inf is safe: every row keeps its diagonal, so no softmax row is all -inf
    mask = torch.full(allowed.shape, float("-inf"), dtype=dtype).masked_fill_(allowed, 0.0)
    return mask[None, None]


def pack(
    samples: Sequence[Sample],
    pad_id: int,
    dtype: torch.dtype = torch.float32,
    *,
    share_prefix: bool = True,
) -> PackedBatch:
    """One packed row for `samples`; `dtype` is the attention compute dtype (the mask's).

    With `share_prefix` (the default) prefixes shared with an earlier sample
    are held once, see the module docstring.
    """
    if not samples:
        raise ValueError("pack() needs at least one sample")
    segments = plan_segments(samples, share_prefix=share_prefix)
    ids: list[int] = []
    pos: list[int] = []
    mask: list[int] = []
    temps: list[float] = []
    lens: list[int] = []
    padded = trainable_batch(collate(list(samples), pad_id))
    width = padded.input_ids.shape[1]
    scatter: list[torch.Tensor] = []
    for seg in segments:
        s, a = samples[seg.sample], seg.start
        n = len(s.input_ids) - a
        ids.extend(s.input_ids[a:])
        pos.extend(range(a, a + n))
        mask.extend([0, *s.loss_mask[a + 1 :]])
        temps.extend(s.temperatures[a:])
        lens.append(n)
        scatter.append(torch.arange(a, a + n) + seg.sample * width)
    return PackedBatch(
        input_ids=torch.tensor([ids], dtype=torch.long),
        position_ids=torch.tensor([pos], dtype=torch.long),
        attention_mask=_additive(_segment_allowed(segments, lens), dtype),
        loss_mask=torch.tensor([mask], dtype=torch.float32),
        temperatures=torch.tensor([temps], dtype=torch.float32),
        seq_lens=lens,
        padded=padded,
        scatter_index=torch.cat(scatter),
    )


def greedy_pack_groups(samples: Sequence[Sample], token_budget: int) -> list[list[Sample]]:
    """Split `samples` in order into groups of at most `token_budget` tokens each.

    A sample longer than the budget gets a group of its own (it is never cut:
    cutting would drop the context its trained tokens were sampled with).
    """
    if token_budget < 1:
        raise ValueError("token_budget must be >= 1: raise pack_tokens")
    groups: list[list[Sample]] = []
    current: list[Sample] = []
    used = 0
    for s in samples:
        n = len(s.input_ids)
        if current and used + n > token_budget:
            groups.append(current)
            current, used = [], 0
        current.append(s)
        used += n
    if current:
        groups.append(current)
    return groups


def padded_groups(samples: Sequence[Sample], micro_batch_size: int) -> list[list[Sample]]:
    """Consecutive groups of `micro_batch_size` samples, for `trainer.batch.collate`."""
    if micro_batch_size < 1:
        raise ValueError("micro_batch_size must be >= 1")
    return [
        list(samples[i : i + micro_batch_size]) for i in range(0, len(samples), micro_batch_size)
    ]
