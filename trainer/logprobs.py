"""Token logprobs and entropy at the trained positions: the one selection every engine uses.

Hidden state t predicts token t+1, so the LM head is applied only at the
positions t whose next token is trained (`loss_mask[:, t + 1] == 1`). That
keeps the [tokens, vocab] logits tensor to the trained tokens instead of the
whole sequence. Each token is scored at its own sampling temperature, as the
inference backend scored it, and the entropy is that of the same tempered
distribution (the full vocabulary row).

Hugging Face models (the local and FSDP engines) go through `PolicyLogits`,
which applies the head inside its own forward: under FSDP that is the root
module, the one that gathers the embeddings, final norm and head. Megatron's
`GPTModel` returns [B, T, V] logits; it calls `logprobs_at` on the rows it
selects with the same mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from trainer.batch import Batch, Sample, collate
from trainer.packing import pack, trainable_batch

# What scores tokens: a `PolicyLogits` (sharded or not), or `trainer.lora.BaseModelView`,
# called as (input_ids, attention_mask, position_ids, select) -> [N, V] logits
Scorer = Callable[..., torch.Tensor]


@dataclass
class Forward:
    """One micro-batch's forward pass, every tensor [S, L] in the padded layout on the device."""

    logp: torch.Tensor  # logprob of each trained token under the policy (with grad)
    entropy: torch.Tensor  # entropy of the tempered distribution at the same positions
    ref_logp: torch.Tensor | None  # the frozen reference's logprobs (kl_coef > 0), no grad
    batch: Batch  # old logprobs, advantages and the loss mask, position 0 never trained


class PolicyLogits(nn.Module):
    """A Hugging Face causal LM: the trunk over every position, the head only where `select`."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None,
        select: torch.Tensor,
    ) -> torch.Tensor:
        # use_cache=False: a KV cache is useless in training, and a checkpointed layer's
        # recompute would append to it a second time
        lm: Any = self.lm  # a Hugging Face PreTrainedModel
        hidden = lm.base_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        ).last_hidden_state
        head = lm.get_output_embeddings()
        return head(hidden[:, :-1][select])


def logprobs_at(
    rows: torch.Tensor,
    input_ids: torch.Tensor,
    select: torch.Tensor,
    temperatures: torch.Tensor,
    *,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, T] logprobs (and entropy, or None) from the logits `rows` [N, V] at `select` [B, T-1].

    Row i holds the logits of the i-th true position of `select`, which
    predicts the token one to its right. 0 wherever `select` is false.
    """
    temps = temperatures[:, 1:][select]
    logp = torch.log_softmax(rows.float() / temps[:, None], dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:][select][:, None]).squeeze(-1)
    out = torch.zeros(select.shape, dtype=picked.dtype, device=picked.device)
    out[select] = picked
    pad = torch.zeros_like(out[:, :1])
    ent = None
    if with_entropy:
        ent = torch.zeros_like(out)
        ent[select] = -(logp.exp() * logp).sum(-1)
        ent = torch.cat([pad, ent], dim=1)
    return torch.cat([pad, out], dim=1), ent


def token_logprobs(
    policy: Scorer,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    loss_mask: torch.Tensor,
    temperatures: torch.Tensor,
    *,
    with_entropy: bool = False,
    keep_graph: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, T] logprob of input_ids[:, t] at its temperature where loss_mask is 1, 0 elsewhere;
    and with `with_entropy` the [B, T] entropy (else None).

    `policy` is a `PolicyLogits` (sharded or not). `keep_graph`: with nothing to train,
    still run the head on one position (its loss weight is 0 through the mask), because
    under FSDP every rank must produce a gradient for every parameter or the collectives
    differ.
    """
    select = loss_mask[:, 1:] > 0
    if keep_graph and not select.any():
        select = torch.zeros_like(select)
        select[0, 0] = True
    rows = policy(input_ids, attention_mask, position_ids, select)
    return logprobs_at(rows, input_ids, select, temperatures, with_entropy=with_entropy)


def hf_forward(
    policy: Scorer,
    reference: Scorer | None,
    chunk: list[Sample],
    pad_id: int,
    device: torch.device,
    *,
    packing: bool = False,
    dtype: torch.dtype = torch.float32,
) -> Forward:
    """Policy (and reference) logprobs of `chunk`, packed into one row or padded.

    A packed row (`trainer.packing`) is unpacked back to the padded layout, so
    the loss sees the same [S, L] tensors either way. `dtype` is the attention
    compute dtype (the packed mask's).
    """
    if packing:
        pb = pack(chunk, pad_id, dtype)
        batch, pos = pb.padded, pb.position_ids
        model_in = (pb.input_ids, pb.attention_mask, pb.loss_mask, pb.temperatures)
    else:
        batch, pos = trainable_batch(collate(chunk, pad_id)), None
        model_in = (batch.input_ids, batch.attention_mask, batch.loss_mask, batch.temperatures)
    ids, attn, mask, temps = (t.to(device) for t in model_in)
    pos = pos if pos is None else pos.to(device)
    logp, entropy = token_logprobs(
        policy, ids, attn, pos, mask, temps, with_entropy=True, keep_graph=True
    )
    assert entropy is not None
    ref = None
    if reference is not None:
        with torch.no_grad():
            ref, _ = token_logprobs(reference, ids, attn, pos, mask, temps)
    if packing:
        logp, entropy = pb.unpack(logp), pb.unpack(entropy)
        ref = ref if ref is None else pb.unpack(ref)
    return Forward(logp, entropy, ref, to_device(batch, device))


def to_device(batch: Batch, device: torch.device) -> Batch:
    return Batch(*(getattr(batch, f.name).to(device) for f in fields(batch)))
