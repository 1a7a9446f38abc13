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
    seq_lens: list[int]
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
    lens = torch.tensor(list(seq_lens), dtype=torch.long)
    seq_id = torch.repeat_interleave(torch.arange(len(lens)), lens)
    pos = torch.arange(len(seq_id))
    allowed = (seq_id[:, None] == seq_id[None, :]) & (pos[:, None] >= pos[None, :])
    # -inf is safe: every row keeps its diagonal, so no softmax row is all -inf
    mask = torch.full(allowed.shape, float("-inf"), dtype=dtype).masked_fill_(allowed, 0.0)
    return mask[None, None]


def pack(samples: Sequence[Sample], pad_id: int, dtype: torch.dtype = torch.float32) -> PackedBatch:
    """One packed row for `samples`; `dtype` is the attention compute dtype (the mask's)."""
    if not samples:
        raise ValueError("pack() needs at least one sample")
    lens = [len(s.input_ids) for s in samples]
    ids, pos, mask, temps = [], [], [], []
    for s in samples:
        ids.extend(s.input_ids)
        pos.extend(range(len(s.input_ids)))
        mask.extend([0, *s.loss_mask[1:]])
        temps.extend(s.temperatures)
    padded = trainable_batch(collate(list(samples), pad_id))
    width = padded.input_ids.shape[1]
    scatter = torch.cat([torch.arange(n) + i * width for i, n in enumerate(lens)])
    return PackedBatch(
        input_ids=torch.tensor([ids], dtype=torch.long),
        position_ids=torch.tensor([pos], dtype=torch.long),
        attention_mask=block_causal_mask(lens, dtype),
        loss_mask=torch.tensor([mask], dtype=torch.float32),
        temperatures=torch.tensor([temps], dtype=torch.float32),
        seq_lens=lens,
        padded=padded,
        scatter_index=scatter,
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
