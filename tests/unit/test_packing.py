"""Sequence packing: layout, block-diagonal mask, and packed == padded on the tiny model."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from trainer import logprobs as trainer_logprobs
from trainer.batch import Sample, collate
from trainer.config import RunConfig
from trainer.local_engine import LocalEngine
from trainer.logprobs import PolicyLogits, token_logprobs
from trainer.losses.ppo import ppo_clip_loss
from trainer.packing import (
    Segment,
    block_causal_mask,
    greedy_pack_groups,
    pack,
    packed_length,
    padded_groups,
    plan_segments,
    trainable_batch,
)

NEG_INF = float("-inf")


def _sample(ids: list[int], n_prompt: int, adv: float = 1.0, temp: float = 1.0) -> Sample:
    n = len(ids)
    return Sample(
        input_ids=ids,
        loss_mask=[0] * n_prompt + [1] * (n - n_prompt),
        old_logprobs=[0.0] * n_prompt + [-5.0 - 0.1 * i for i in range(n - n_prompt)],
        advantages=[0.0] * n_prompt + [adv] * (n - n_prompt),
        temperatures=[1.0] * n_prompt + [temp] * (n - n_prompt),
        min_version=0,
    )


def _random_samples(n: int, vocab: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(5, 30)
        ids = [rng.randrange(3, vocab) for _ in range(length)]
        adv, temp = rng.choice([-1.0, 0.5, 2.0]), rng.choice([1.0, 0.7])
        out.append(_sample(ids, rng.randint(1, length - 2), adv, temp))
    return out


def test_packed_row_concatenates_ids_and_restarts_positions() -> None:
    samples = [_sample([5, 6, 7], 1), _sample([8, 9, 10, 11], 2), _sample([12, 13], 1)]
    pb = pack(samples, pad_id=0)
    assert pb.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13]]
    assert pb.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 1]]
    assert pb.seq_lens == [3, 4, 2]
    # a sample's first token is never trained: the position before it is another sample's
    assert pb.loss_mask.tolist() == [[0, 1, 1, 0, 0, 1, 1, 0, 1]]
    assert pb.padded.input_ids.shape == (3, 4)


def test_block_causal_mask_is_block_diagonal_and_causal() -> None:
    mask = block_causal_mask([2, 3])
    assert mask.shape == (1, 1, 5, 5)
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ]
    assert set(mask.unique().tolist()) == {0.0, NEG_INF}
    assert block_causal_mask([2, 3], torch.bfloat16).dtype == torch.bfloat16


def test_unpack_puts_each_position_back_in_its_padded_row() -> None:
    samples = [_sample([5, 6, 7], 1), _sample([8, 9], 1)]
    pb = pack(samples, pad_id=0)
    back = pb.unpack(pb.input_ids.float())
    assert back.tolist() == [[5, 6, 7], [8, 9, 0]]


def test_greedy_groups_respect_the_budget_and_keep_order() -> None:
    samples = [_sample([1] * n, 1) for n in (4, 3, 5, 9, 2, 2)]
    groups = greedy_pack_groups(samples, token_budget=8)
    assert [[len(s.input_ids) for s in g] for g in groups] == [[4, 3], [5], [9], [2, 2]]
    assert [s for g in groups for s in g] == samples
    assert [len(g) for g in padded_groups(samples, 4)] == [4, 2]
    with pytest.raises(ValueError, match="pack_tokens"):
        greedy_pack_groups(samples, 0)


def _policy(model_dir: Path, attn: str) -> PolicyLogits:
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attn
    )
    return PolicyLogits(lm).eval()


def _padded_logprobs(policy: PolicyLogits, samples: list[Sample], pad_id: int):
    batch = trainable_batch(collate(samples, pad_id))
    logp, _ = token_logprobs(
        policy, batch.input_ids, batch.attention_mask, None, batch.loss_mask, batch.temperatures
    )
    return logp, batch


def _packed_logprobs(policy: PolicyLogits, samples: list[Sample], pad_id: int, mask=True):
    pb = pack(samples, pad_id)
    attn = pb.attention_mask if mask else None
    logp, _ = token_logprobs(
        policy, pb.input_ids, attn, pb.position_ids, pb.loss_mask, pb.temperatures
    )
    return pb.unpack(logp), pb.padded


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_packed_and_padded_give_the_same_logprobs_loss_and_gradient(
    tiny_model_dir: Path, attn: str, agg: str
) -> None:
    policy = _policy(tiny_model_dir, attn)
    pad_id = policy.lm.config.pad_token_id
    samples = _random_samples(6, policy.lm.config.vocab_size)
    results = []
    for fn in (_padded_logprobs, _packed_logprobs):
        policy.zero_grad(set_to_none=True)
        logp, batch = fn(policy, samples, pad_id)
        loss, _ = ppo_clip_loss(
            logp, batch.old_logprobs, batch.advantages, batch.loss_mask, agg=agg
        )
        loss.backward()
        grad = policy.lm.get_output_embeddings().weight.grad.clone()
        results.append((logp.detach(), batch.loss_mask, loss.detach().item(), grad))
    (lp_pad, mask_pad, loss_pad, g_pad), (lp_pack, mask_pack, loss_pack, g_pack) = results
    assert torch.equal(mask_pad, mask_pack)
    assert int(mask_pad.sum()) > 30
    torch.testing.assert_close(lp_pack, lp_pad, atol=1e-5, rtol=0)
    assert loss_pack == pytest.approx(loss_pad, abs=1e-5)
    torch.testing.assert_close(g_pack, g_pad, atol=1e-5, rtol=1e-4)


def test_padded_path_matches_local_engine(tiny_model_dir: Path) -> None:
    engine = LocalEngine(tiny_model_dir, 0, RunConfig())
    engine.model.eval()
    samples = _random_samples(4, engine.model.config.vocab_size, seed=1)
    batch = collate(samples, engine.pad_id)
    with torch.no_grad():
        ref = engine.token_logprobs(batch)
        ours, _ = _padded_logprobs(PolicyLogits(engine.model), samples, engine.pad_id)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)


def test_without_the_block_mask_samples_would_see_each_other(tiny_model_dir: Path) -> None:
    """Guards the comparison above: packing with a plain causal mask is measurably wrong."""
    policy = _policy(tiny_model_dir, "eager")
    pad_id = policy.lm.config.pad_token_id
    samples = _random_samples(3, policy.lm.config.vocab_size, seed=2)
    with torch.no_grad():
        ref, _ = _padded_logprobs(policy, samples, pad_id)
        leaky, _ = _packed_logprobs(policy, samples, pad_id, mask=False)
        # transformers 5 infers packing from restarting position_ids when no mask is given;
        # a plain causal 4D mask disables that inference and lets attention cross samples
        pb = pack(samples, pad_id)
        causal = block_causal_mask([pb.num_tokens])
        logp, _ = token_logprobs(
            policy, pb.input_ids, causal, pb.position_ids, pb.loss_mask, pb.temperatures
        )
        crossed = pb.unpack(logp)
    torch.testing.assert_close(leaky, ref, atol=1e-5, rtol=0)
    assert (crossed - ref).abs().max() > 1e-3


# --- shared prefixes --------------------------------------------------------------------


def _grouped_samples(vocab: int, seed: int = 0) -> list[Sample]:
    """Two groups of GRPO samples behind one system prompt, plus a multi-turn sample.

    The multi-turn sample repeats group A's prompt but trains a token inside it
    (an earlier assistant turn), so it may share only up to that token.
    """
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    system = ids(6)
    out = []
    for _ in range(2):
        prompt = system + ids(rng.randint(4, 9))
        for _ in range(3):
            completion = ids(rng.randint(2, 7))
            adv, temp = rng.choice([-1.0, 0.5, 2.0]), rng.choice([1.0, 0.7])
            out.append(_sample(prompt + completion, len(prompt), adv, temp))
    first = out[0]
    n_prompt = first.loss_mask.index(1)
    turn = first.input_ids[:n_prompt] + ids(5)
    mask = [0] * len(turn)
    mask[8] = 1  # a trained id inside the shared prompt
    mask[-3:] = [1, 1, 1]
    out.append(
        Sample(
            input_ids=turn,
            loss_mask=mask,
            old_logprobs=[-4.0 if m else 0.0 for m in mask],
            advantages=[1.5 if m else 0.0 for m in mask],
            temperatures=[1.0] * len(turn),
            min_version=0,
        )
    )
    return out


def test_a_group_stores_its_prompt_once() -> None:
    prompt = [5, 6, 7, 8]
    samples = [_sample([*prompt, 9, 10], 4), _sample([*prompt, 11], 4), _sample([1, 2, 3], 1)]
    pb = pack(samples, pad_id=0)
    # the branch holds a copy of the last shared id (8, at position 3) and its own answer
    assert pb.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 8, 11, 1, 2, 3]]
    assert pb.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 3, 4, 0, 1, 2]]
    assert pb.seq_lens == [6, 2, 3]
    assert pb.loss_mask.tolist() == [[0, 0, 0, 0, 1, 1, 0, 1, 0, 1, 1]]
    allowed = (pb.attention_mask[0, 0] == 0).int()
    assert allowed[6].tolist() == [1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0]  # the prefix, then itself
    assert allowed[7].tolist() == [1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0]
    assert allowed[8].tolist() == [0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0]  # unrelated: its own only
    back = pb.unpack(pb.input_ids.float())
    assert back.tolist() == [[5, 6, 7, 8, 9, 10], [0, 0, 0, 8, 11, 0], [1, 2, 3, 0, 0, 0]]
    unshared = pack(samples, pad_id=0, share_prefix=False)
    assert unshared.num_tokens == 14 and pb.num_tokens == 11


def test_branches_nest_and_stop_at_the_first_trained_id() -> None:
    vocab = 64
    samples = _grouped_samples(vocab)
    segments = plan_segments(samples)
    assert [s.parent for s in segments[:3]] == [None, 0, 0]  # group A under its first sample
    assert segments[3].parent == 0 and segments[3].start == 5  # group B: the system prompt
    assert [s.parent for s in segments[4:6]] == [3, 3]  # B's prompt, nested under B's first
    assert segments[6].parent == 0 and segments[6].start == 7  # shares up to its trained id 8
    assert plan_segments(samples, share_prefix=False) == [
        Segment(i, 0, None) for i in range(len(samples))
    ]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_prefix_packing_gives_the_padded_logprobs_entropy_loss_and_gradient(
    tiny_model_dir: Path, attn: str
) -> None:
    policy = _policy(tiny_model_dir, attn)
    pad_id = policy.lm.config.pad_token_id
    samples = _grouped_samples(policy.lm.config.vocab_size, seed=3)
    shared = pack(samples, pad_id)
    assert shared.num_tokens < pack(samples, pad_id, share_prefix=False).num_tokens * 0.7
    results = []
    for packed in (False, True):
        policy.zero_grad(set_to_none=True)
        if packed:
            logp, ent = token_logprobs(
                policy,
                shared.input_ids,
                shared.attention_mask,
                shared.position_ids,
                shared.loss_mask,
                shared.temperatures,
                with_entropy=True,
            )
            logp, ent, batch = shared.unpack(logp), shared.unpack(ent), shared.padded
        else:
            batch = trainable_batch(collate(samples, pad_id))
            logp, ent = token_logprobs(
                policy,
                batch.input_ids,
                batch.attention_mask,
                None,
                batch.loss_mask,
                batch.temperatures,
                with_entropy=True,
            )
        loss, _ = ppo_clip_loss(logp, batch.old_logprobs, batch.advantages, batch.loss_mask)
        loss.backward()
        grads = [p.grad.clone() for p in policy.parameters() if p.grad is not None]
        results.append((logp.detach(), ent.detach(), batch.loss_mask, loss.item(), grads))
    (lp0, e0, m0, l0, g0), (lp1, e1, m1, l1, g1) = results
    assert torch.equal(m0, m1)
    assert int(m0.sum()) > 20
    torch.testing.assert_close(lp1 * m1, lp0 * m0, atol=1e-5, rtol=0)
    torch.testing.assert_close(e1 * m1, e0 * m0, atol=1e-5, rtol=0)
    assert l1 == pytest.approx(l0, abs=1e-5)
    assert len(g0) == len(g1) > 2
    for a, b in zip(g0, g1, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


def test_local_engine_packs_within_the_budget_and_pads_beyond(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded trainer's forward: the packed row (shared prefixes) or, past
    `parallel.pack_tokens`, the padded layout; both give the same logprobs."""
    packed_rows: list[int] = []
    real_pack = trainer_logprobs.pack

    def spy(*args, **kwargs):
        pb = real_pack(*args, **kwargs)
        packed_rows.append(pb.num_tokens)
        return pb

    monkeypatch.setattr(trainer_logprobs, "pack", spy)
    out = {}
    for budget in (1024, 8):
        engine = LocalEngine(tiny_model_dir, 0, RunConfig(parallel={"pack_tokens": budget}))
        engine.model.eval()
        samples = _grouped_samples(engine.model.config.vocab_size, seed=4)
        with torch.no_grad():
            fwd = engine.forward(samples)
        out[budget] = fwd.logp * fwd.batch.loss_mask
    # one packed row, shorter than the samples laid end to end; the small budget padded
    assert packed_rows == [packed_length(samples)]
    assert packed_rows[0] < sum(len(s.input_ids) for s in samples)
    torch.testing.assert_close(out[1024], out[8], atol=1e-5, rtol=0)
