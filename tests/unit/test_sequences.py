"""Sequence assembly on trees: each sampled token trained once; orphaned retries left out."""

from __future__ import annotations

import pytest
import torch

from core.store.models import Completion
from trainer.batch import collate, sample_from_completion
from trainer.losses.ppo import ppo_per_token
from trainer.sequences import AssemblyStats, Turn, assemble, orphaned_retries


def turn(tid, parent, prompt, out, order, spliced=True, prompt_hash=None, version=0):
    return Turn(
        tid,
        parent,
        prompt,
        out,
        [-1.0] * len(out),
        1.0,
        version,
        spliced,
        prompt_hash or f"h-{tid}",
        order,
    )


ROOT = turn("r", None, [1, 2], [3, 4], 0, spliced=False)
# two branches continue r: each prompt = r's prompt + r's output + new ids
LEFT = turn("l", "r", [1, 2, 3, 4, 5], [6], 1)
RIGHT = turn("x", "r", [1, 2, 3, 4, 7], [8, 9], 2, version=1)


def test_branches_train_the_shared_turn_once() -> None:
    stats = AssemblyStats()
    samples = assemble([ROOT, LEFT, RIGHT], {"r": 0.5, "l": 1.0, "x": -1.0}, stats=stats)
    assert [s.input_ids for s in samples] == [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8, 9]]
    assert samples[0].loss_mask == [0, 0, 1, 1, 0, 1]  # r's output and l's output
    assert samples[1].loss_mask == [0, 0, 0, 0, 0, 1, 1]  # r already trained: context here
    assert samples[0].advantages == [0, 0, 0.5, 0.5, 0, 1.0]
    assert samples[1].advantages[-2:] == [-1.0, -1.0]
    assert samples[1].min_version == 1 and samples[0].min_version == 0
    assert stats.sequences == 2 and stats.drift_segments == 0


def test_drifted_child_starts_its_own_sequence() -> None:
    drifted = turn("d", "r", [1, 9, 9, 5], [6], 1, spliced=False)
    stats = AssemblyStats()
    samples = assemble([ROOT, drifted], {"r": 1.0, "d": 1.0}, stats=stats)
    assert [s.input_ids for s in samples] == [[1, 2, 3, 4], [1, 9, 9, 5, 6]]
    assert stats.drift_segments == 1


def test_orphaned_retry_is_excluded_by_default() -> None:
    first = turn("a", None, [1, 2], [3], 0, spliced=False, prompt_hash="same")
    retry = turn("b", None, [1, 2], [4], 1, spliced=False, prompt_hash="same")
    assert orphaned_retries([first, retry]) == {"a"}
    stats = AssemblyStats()
    samples = assemble([first, retry], {"a": 1.0, "b": 1.0}, stats=stats)
    assert [s.input_ids for s in samples] == [[1, 2, 4]]
    assert stats.orphans_excluded == 1
    both = assemble([first, retry], {"a": 1.0, "b": 1.0}, train_orphans=True)
    assert len(both) == 2


def test_retry_that_was_continued_is_not_an_orphan() -> None:
    first = turn("a", None, [1, 2], [3], 0, spliced=False, prompt_hash="same")
    retry = turn("b", None, [1, 2], [4], 1, spliced=False, prompt_hash="same")
    child = turn("c", "a", [1, 2, 3, 5], [6], 2)  # the agent continued from the first answer
    assert orphaned_retries([first, retry, child]) == set()


def test_turn_without_advantage_is_context_only() -> None:
    samples = assemble([ROOT, LEFT], {"r": None, "l": 2.0})
    assert samples[0].loss_mask == [0, 0, 0, 0, 0, 1]


# --- a turn sampled by two versions (a keep-mode hot swap in the middle) --------------------


def test_a_mixed_version_turn_trains_each_token_against_its_own_behaviour_logprob() -> None:
    # Tokens 0-1 sampled by version 3, tokens 2-3 by version 4: each logprob is the one
    # its own version reported (`GenerateResult.output_logprobs`), so they differ in kind.
    lps = [-0.1, -0.2, -1.3, -1.4]
    row = Completion(
        prompt_token_ids=[1, 2],
        output_token_ids=[5, 6, 7, 8],
        output_logprobs=lps,
        temperature=1.0,
        policy_version=3,
        version_starts=[[0, 3], [2, 4]],
    )
    assert row.token_versions() == [3, 3, 4, 4]
    alone = sample_from_completion(row, 1.0)
    first = turn("a", None, [1, 2], [5, 6, 7, 8], 0, spliced=False, version=3)
    first = Turn(**{**first.__dict__, "output_logprobs": lps})
    then = turn("b", "a", [1, 2, 5, 6, 7, 8, 9], [10], 1, version=4)
    [spliced] = assemble([first, then], {"a": 1.0, "b": 1.0})
    for sample in (alone, spliced):
        assert sample.old_logprobs[2:6] == lps  # per token, from whichever version sampled it
        assert sample.min_version == 3  # staleness counts the oldest token's version

    # The PPO ratio of token t is pi_current(t) / pi_behaviour(t), with t's own behaviour
    # logprob: a current policy 0.05 nats above every behaviour logprob gives one ratio.
    batch = collate([alone], pad_id=0)
    logp = batch.old_logprobs + 0.05 * batch.loss_mask
    per_token, mask, metrics = ppo_per_token(
        logp, batch.old_logprobs, batch.advantages, batch.loss_mask, 0.2, 0.2
    )
    want = torch.tensor([[0, 0] + [-torch.exp(torch.tensor(0.05)).item()] * 4])
    assert torch.allclose(per_token, want) and mask.sum() == 4
    assert metrics["ratio_max"] == pytest.approx(metrics["ratio_mean"])

    # Decoupled PPO (behaviour_weight_cap): the ratio is against pi_prox (the current
    # weights), and each token is weighted by pi_prox / pi_behaviour of its own version.
    per_token, _, metrics = ppo_per_token(
        logp, batch.old_logprobs, batch.advantages, batch.loss_mask, 0.2, 0.2, 2.0
    )
    assert torch.allclose(per_token, want)  # ratio 1, weight exp(0.05) on every token
    assert metrics["iw_max"] == pytest.approx(metrics["iw_mean"])
