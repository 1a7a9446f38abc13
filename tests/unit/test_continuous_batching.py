"""Continuous batching in the local backend: rows join mid-decode and leave when done,
shared prefixes are prefilled once, the KV cache has a cap; and every logprob still equals
a float32 recomputation of the same tokens, whatever the row's batch-mates.

The tiny model (random 2-layer Llama) on the CPU, no mocks.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from inference.backend import BackendOverloaded
from inference.chat_template import ChatTemplate
from inference.local import LocalBackend
from inference.prefix_cache import MIN_REUSE, PrefixCache
from inference.types import GenerateRequest, SamplingParams
from tests.unit.test_lora_batch import make_adapter

TOL = 2e-4  # float32 rounding of one logprob computed in another batch or split
SYSTEM = {"role": "system", "content": "You are a careful assistant. Answer with one number."}
QUESTIONS = ["what is one plus two?", "hello there", "count the letters in fox", "yes no maybe"]


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: Path) -> list[list[int]]:
    template = ChatTemplate(tiny_model_dir)
    return [template.render([SYSTEM, {"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture
async def backend(tiny_model_dir: Path) -> AsyncIterator[LocalBackend]:
    be = LocalBackend(tiny_model_dir, batch_wait_s=0.05)
    try:
        yield be
    finally:
        await be.close()


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)


def _recomputed(
    model: torch.nn.Module, prompt: list[int], out: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """Logprobs of `out` after `prompt` from one float32 forward of the whole sequence."""
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logp.gather(-1, torch.tensor(out)[:, None]).squeeze(-1)


def _step_widths(backend: LocalBackend, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of each decode step `backend` runs from now on, filled as it runs."""
    widths: list[int] = []
    real_step = backend._decode_step

    def step(batch):
        widths.append(len(batch.rows))
        return real_step(batch)

    monkeypatch.setattr(backend, "_decode_step", step)
    return widths


def _close(got: list[float], ref: torch.Tensor) -> bool:
    return torch.allclose(torch.tensor(got), ref, atol=TOL, rtol=0)


async def test_a_row_joins_a_running_batch_and_computes_as_if_alone(
    backend: LocalBackend, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request that arrives while another decodes joins at the next step: its first token
    comes before the other ends, its greedy tokens are its solo run's, and its sampled
    logprobs equal a float32 recomputation."""
    solo = await backend.generate(GenerateRequest(prompts[1], _greedy(12)))
    backend.prefixes.drop(everything=True)
    widths = _step_widths(backend, monkeypatch)
    long = backend.start_stream(GenerateRequest(prompts[0], _greedy(60)))
    tokens = long.tokens()
    for _ in range(5):  # the long row is decoding
        await anext(tokens)
    sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=11)
    joined = await asyncio.gather(
        backend.generate(GenerateRequest(prompts[1], _greedy(12))),
        backend.generate(GenerateRequest(prompts[2], sampled)),
    )
    assert not long._job.future.done(), "the long row ended before the others joined it"
    first = await long.result()
    assert len(first.output_token_ids) == 60
    assert max(widths) == 3 and widths[-1] == 1  # they decoded together, then left
    assert joined[0].output_token_ids == solo.output_token_ids
    model = backend.model
    assert _close(joined[0].output_logprobs, _recomputed(model, prompts[1], solo.output_token_ids))
    out = joined[1].output_token_ids
    assert _close(joined[1].output_logprobs, _recomputed(model, prompts[2], out, 0.8))
    assert _close(first.output_logprobs, _recomputed(model, prompts[0], first.output_token_ids))


async def test_a_group_prefills_its_prompt_once_and_each_row_samples_its_own(
    backend: LocalBackend, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four rows of one prompt (a GRPO group) arriving together: one prefill row, and each
    row's tokens are those of the same seed alone."""
    prefills: list[int] = []  # rows of each prefill forward
    real = backend._prefill_prompts

    def count(rows):
        prefills.append(len(rows))
        return real(rows)

    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=s) for s in range(4)]
    alone = [await backend.generate(GenerateRequest(prompts[3], p)) for p in params]
    backend.prefixes.drop(everything=True)
    monkeypatch.setattr(backend, "_prefill_prompts", count)
    calls = [backend.generate(GenerateRequest(prompts[3], p)) for p in params]
    group = await asyncio.gather(*calls)
    assert prefills == [1]
    assert [g.output_token_ids for g in group] == [a.output_token_ids for a in alone]
    assert len({tuple(g.output_token_ids) for g in group}) > 1  # the rows are not copies
    for g in group:
        assert _close(g.output_logprobs, _recomputed(backend.model, prompts[3], g.output_token_ids))


async def test_a_shared_prefix_is_reused_across_calls_and_dropped_by_a_swap(
    backend: LocalBackend, prompts: list[list[int]], tiny_model_dir: Path
) -> None:
    """A later prompt that shares the system prompt (or extends an earlier turn) prefills
    only what is new; the logprobs equal a recomputation; a swap of the weights empties
    the cache, so the next call is computed by the new weights alone."""
    first = await backend.generate(GenerateRequest(prompts[0], _greedy(6)))
    turn2 = prompts[0] + first.output_token_ids + prompts[1][-6:]
    for prompt in (prompts[1], turn2):
        hits, reused = backend.prefixes.hits, backend.prefixes.reused_tokens
        r = await backend.generate(GenerateRequest(prompt, _greedy(8)))
        assert backend.prefixes.hits == hits + 1
        assert backend.prefixes.reused_tokens - reused >= MIN_REUSE
        assert _close(r.output_logprobs, _recomputed(backend.model, prompt, r.output_token_ids))
    assert backend.prefixes.reused_tokens >= len(prompts[0])  # turn 2 reused all of turn 1's
    await backend.load_weights(tiny_model_dir, 1)
    assert len(backend.prefixes) == 0
    after = await backend.generate(GenerateRequest(prompts[1], _greedy(8)))
    assert after.policy_version == 1
    ref = _recomputed(backend.model, prompts[1], after.output_token_ids)
    assert _close(after.output_logprobs, ref)


async def test_an_adapter_never_reuses_the_base_models_prefix(
    backend: LocalBackend, prompts: list[list[int]], tiny_model_dir: Path, tmp_path: Path
) -> None:
    adapter = make_adapter(tiny_model_dir, tmp_path / "a", 1, 4, ["q_proj", "v_proj"])
    await backend.load_adapter("run_a", adapter, 1)
    await backend.generate(GenerateRequest(prompts[0], _greedy(4)))
    hits = backend.prefixes.hits
    r = await backend.generate(GenerateRequest(prompts[0], _greedy(8), adapter="run_a"))
    assert backend.prefixes.hits == hits  # same tokens, other weights: computed afresh
    again = await backend.generate(GenerateRequest(prompts[0], _greedy(8), adapter="run_a"))
    assert backend.prefixes.hits == hits + 1
    assert again.output_token_ids == r.output_token_ids
    assert again.output_logprobs == pytest.approx(r.output_logprobs, abs=TOL)


async def test_a_cancelled_row_leaves_with_its_cache_at_once(
    backend: LocalBackend, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled before the fourth decode step: that step and every later one feed the
    other row alone (the cancelled row's cache row is gone)."""
    steps, fed = 0, []
    real_step = backend._decode_step

    def step(batch):
        nonlocal steps
        steps += 1
        if steps == 4:
            go.cancel()
        return real_step(batch)

    def feed(_module: torch.nn.Module, _args: tuple, kwargs: dict) -> None:
        if kwargs["input_ids"].shape[1] == 1:
            fed.append(int(kwargs["past_key_values"].layers[0].keys.shape[0]))

    monkeypatch.setattr(backend, "_decode_step", step)
    hook = backend.model.register_forward_pre_hook(feed, with_kwargs=True)
    try:
        stay = backend.start_stream(GenerateRequest(prompts[0], _greedy(40)))
        go = backend.start_stream(GenerateRequest(prompts[1], _greedy(40)))
        cancelled, kept = await go.result(), await stay.result()
    finally:
        hook.remove()
    assert cancelled.finish_reason == "cancelled" and len(cancelled.output_token_ids) == 4
    assert len(kept.output_token_ids) == 40
    assert fed == [2, 2, 2] + [1] * 36


async def test_the_kv_cap_makes_a_request_wait_and_refuses_one_that_never_fits(
    tiny_model_dir: Path, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    probe = LocalBackend(tiny_model_dir)
    per_token = probe._kv_token_bytes
    await probe.close()
    need = len(prompts[0]) + 30
    backend = LocalBackend(tiny_model_dir, kv_cache_bytes=int(need * 1.5) * per_token)
    widths = _step_widths(backend, monkeypatch)
    try:
        with pytest.raises(BackendOverloaded, match="KV cache"):
            await backend.generate(GenerateRequest(prompts[0], _greedy(need * 2)))
        both = await asyncio.gather(
            *(backend.generate(GenerateRequest(p, _greedy(30))) for p in prompts[:2])
        )
        assert [len(r.output_token_ids) for r in both] == [30, 30]
        assert widths and max(widths) == 1  # the second waited for the first's cache
        widths.clear()
        backend.kv_cache_bytes = 3 * need * per_token  # room for two: they decode together
        await asyncio.gather(
            *(backend.generate(GenerateRequest(p, _greedy(30))) for p in prompts[:2])
        )
        assert max(widths) == 2
    finally:
        await backend.close()


def test_the_prefix_cache_evicts_the_least_recently_used_past_its_size() -> None:
    def kv(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.randn(1, 2, n, 4), torch.randn(1, 2, n, 4))]

    per_token = 2 * 2 * 4 * 4  # keys and values, 2 heads, dim 4, float32
    cache = PrefixCache(max_bytes=3 * 20 * per_token)
    key = (None, None, 0)
    prompts = [[i] * 20 for i in range(1, 5)]
    for p in prompts[:3]:
        cache.store(key, p, kv(20))
    assert len(cache) == 3
    assert cache.lookup(key, prompts[0] + [9])[0] == 20  # touched: now the newest
    cache.store(key, prompts[3], kv(20))  # evicts prompts[1], the least recently used
    assert len(cache) == 3 and cache.nbytes <= cache.max_bytes
    assert cache.lookup(key, prompts[1] + [9]) == (0, None)
    assert cache.lookup(key, prompts[0] + [9])[0] == 20
    assert cache.lookup((None, None, 1), prompts[0] + [9]) == (0, None)  # other weights
    n, found = cache.lookup(key, prompts[0])  # the whole prompt: all but its last token
    assert n == 19 and found is not None and found[0][0].shape[2] == 19
    assert cache.lookup(key, prompts[0][:MIN_REUSE]) == (0, None)  # too short to reuse
    cache.drop(everything=True)
    assert len(cache) == 0 and cache.nbytes == 0


async def test_rows_with_and_without_a_stored_prefix_prefill_together(
    backend: LocalBackend, prompts: list[list[int]], tiny_model_dir: Path
) -> None:
    """One forward prefills a row that reuses a long prefix, one that reuses a short one and
    one that reuses none (padding between each row's two parts); each computes as alone."""
    template = ChatTemplate(tiny_model_dir)
    first = await backend.generate(GenerateRequest(prompts[0], _greedy(6)))
    rows = [
        prompts[0] + first.output_token_ids + prompts[1][-6:],  # all of turn 1 reused
        prompts[2],  # the system prompt reused
        template.render([{"role": "user", "content": "no system prompt here at all"}]),
    ]
    hits = backend.prefixes.hits
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=3)
    together = await asyncio.gather(*(backend.generate(GenerateRequest(p, sampled)) for p in rows))
    assert backend.prefixes.hits == hits + 2
    for prompt, r in zip(rows, together, strict=True):
        assert _close(r.output_logprobs, _recomputed(backend.model, prompt, r.output_token_ids))
    backend.prefixes.drop(everything=True)
    for prompt, r in zip(rows, together, strict=True):  # alone, nothing reused: same tokens
        alone = await backend.generate(GenerateRequest(prompt, sampled))
        assert alone.output_token_ids == r.output_token_ids


async def test_requests_waiting_in_line_count_against_max_pending(
    tiny_model_dir: Path, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one row decoding (held) and a full batch, two more wait; a third is refused."""
    backend = LocalBackend(tiny_model_dir, max_batch_size=1, max_pending=2, batch_wait_s=0.0)
    held, release = threading.Event(), threading.Event()
    real_step = backend._decode_step

    def step(batch):
        held.set()
        release.wait(60)
        return real_step(batch)

    monkeypatch.setattr(backend, "_decode_step", step)
    try:
        first = backend.start_stream(GenerateRequest(prompts[0], _greedy(4)))
        assert await asyncio.to_thread(held.wait, 60)
        waiting = [backend.start_stream(GenerateRequest(p, _greedy(4))) for p in prompts[1:3]]
        with pytest.raises(BackendOverloaded, match="already waiting"):
            backend.start_stream(GenerateRequest(prompts[3], _greedy(4)))
        release.set()
        for s in [first, *waiting]:
            assert len((await s.result()).output_token_ids) == 4
        again = await backend.generate(GenerateRequest(prompts[3], _greedy(4)))  # room again
        assert len(again.output_token_ids) == 4
    finally:
        release.set()
        await backend.close()
