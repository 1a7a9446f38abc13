"""Keep-mode hot swaps in the local backend: the swap lands between two decode steps of a
running batch, each token records the version that sampled it, and `clear_kv` decides
whether the rows that go on decode over a cache the new weights recomputed.

The batch is held inside the forward that samples token `AT` (a hook on the model, no
sleeps); the swap is handed to the worker while it is held, so it lands right after that
token: every swapped row's second version begins at token `AT + 1`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import torch

from inference.backend import BackendError
from inference.chat_template import ChatTemplate
from inference.local import LocalBackend
from inference.types import (
    KEEP,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    SwapPolicy,
)
from tests.unit.test_lora_batch import make_adapter

AT = 20  # the swap lands after token AT: the new version begins at AT + 1
N = 60  # tokens per generation
TOL = 1e-4  # cached decoding vs a float32 teacher-forced forward (as test_local_backend)
NO_CLEAR = SwapPolicy(clear_kv=False)


def _model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: Path) -> list[list[int]]:
    t = ChatTemplate(tiny_model_dir)
    texts = ["the quick brown fox jumps over the lazy dog. 7 8 9", "hello", "yes no maybe"]
    return [t.render([{"role": "user", "content": x}]) for x in texts]


@pytest.fixture(scope="module")
def perturbed(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with every weight moved: the KV cache changes, not only the logits."""
    out = tmp_path_factory.mktemp("ckpt") / "v1"
    model = _model(tiny_model_dir)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5 * p.std().clamp(min=1e-3))
    model.save_pretrained(out)
    return out


@pytest.fixture
async def backend(tiny_model_dir: Path) -> AsyncIterator[LocalBackend]:
    be = LocalBackend(tiny_model_dir, batch_wait_s=0.5)
    try:
        yield be
    finally:
        await be.close()


def _greedy(n: int = N) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)


async def _swap_after_token(
    backend: LocalBackend,
    requests: list[GenerateRequest],
    swap: Callable[[], Awaitable[None]],
    monkeypatch: pytest.MonkeyPatch,
) -> list[GenerateResult]:
    """Run `requests` as one batch, with `swap` handed to the worker while the forward that
    samples token AT is held; the results, in order."""
    held, release, handed = threading.Event(), threading.Event(), threading.Event()
    decode_steps, sizes = 0, []

    real_defer, real_step, real_join = (
        backend._defer_to_next_step,
        backend._decode_step,
        backend._prefill,
    )

    def step(batch):  # the decode step that samples token k: held at k == AT
        nonlocal decode_steps
        decode_steps += 1
        if decode_steps == AT:
            held.set()
            release.wait(60)
        return real_step(batch)

    def defer(swap):
        future = real_defer(swap)
        handed.set()
        return future

    def join(rows, batch):
        sizes.append(len(rows))
        return real_join(rows, batch)

    monkeypatch.setattr(backend, "_defer_to_next_step", defer)
    monkeypatch.setattr(backend, "_decode_step", step)
    monkeypatch.setattr(backend, "_prefill", join)
    try:
        streams = [backend.start_stream(r) for r in requests]
        assert await asyncio.to_thread(held.wait, 60), "the batch never reached token AT"
        swapping = asyncio.ensure_future(swap())
        assert await asyncio.to_thread(handed.wait, 60), "the swap never reached the worker"
    finally:
        release.set()
    await asyncio.wait_for(swapping, 60)
    results = [await s.result() for s in streams]
    assert sizes == [len(requests)], f"the requests did not join as one: {sizes}"
    return results


def _teacher_forced(model: torch.nn.Module, prompt: list[int], out: list[int]) -> torch.Tensor:
    """Logprobs (temperature 1) of `out` after `prompt`, from one float32 forward."""
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
    return logp.gather(-1, ids[0, 1:, None]).squeeze(-1)[-len(out) :]


def _over_old_cache(
    old: torch.nn.Module, new: torch.nn.Module, prompt: list[int], out: list[int], start: int
) -> torch.Tensor:
    """Logprobs of `out[start:]` when the old weights computed the cache of everything
    before `out[start - 1]` and the new weights compute the rest on top of it."""
    ids = prompt + out
    cut = len(prompt) + start - 1
    with torch.no_grad():
        cache = old(input_ids=torch.tensor([ids[:cut]]), use_cache=True).past_key_values
        logits = new(input_ids=torch.tensor([ids[cut:-1]]), past_key_values=cache).logits[0]
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, torch.tensor(ids[cut + 1 :])[:, None]).squeeze(-1)


def _close(got: list[float], ref: torch.Tensor, atol: float = TOL) -> bool:
    return torch.allclose(torch.tensor(got), ref, atol=atol, rtol=0)


@pytest.mark.parametrize("policy", [KEEP, NO_CLEAR], ids=["clear_kv", "keep_kv"])
async def test_a_keep_swap_lands_between_two_steps_and_marks_each_row(
    backend: LocalBackend,
    prompts: list[list[int]],
    tiny_model_dir: Path,
    perturbed: Path,
    monkeypatch: pytest.MonkeyPatch,
    policy: SwapPolicy,
) -> None:
    """Three rows: greedy and sampled rows that span the swap, and a short one that ends
    before it (unmarked). Before the boundary every logprob is the old weights'; after it
    the new weights' over a recomputed cache (clear_kv) or over the old cache (keep_kv)."""
    greedy = GenerateRequest(prompts[0], _greedy())
    sampled = GenerateRequest(prompts[1], SamplingParams(max_tokens=N, temperature=1.0, seed=3))
    short = GenerateRequest(prompts[2], _greedy(AT // 2))
    solo = await backend.generate(greedy)

    async def swap() -> None:
        await backend.load_weights(perturbed, 1, policy)

    results = await _swap_after_token(backend, [greedy, sampled, short], swap, monkeypatch)
    assert backend.version == 1
    b = AT + 1
    for r in results[:2]:
        assert (r.policy_version, r.version_starts) == (0, ((0, 0), (b, 1)))
        assert len(r.output_token_ids) == N and r.finish_reason == "length"
    assert (results[2].policy_version, results[2].version_starts) == (0, ())
    assert len(results[2].output_token_ids) == AT // 2
    assert results[0].output_token_ids[:b] == solo.output_token_ids[:b]

    old, new = _model(tiny_model_dir), _model(perturbed)
    for prompt, r in zip(prompts[:2], results[:2], strict=True):
        by_old = _teacher_forced(old, prompt, r.output_token_ids)
        by_new = _teacher_forced(new, prompt, r.output_token_ids)
        assert _close(r.output_logprobs[:b], by_old[:b])
        assert not _close(r.output_logprobs[b:], by_old[b:], atol=1e-2)  # the swap took
        if policy.clear_kv:
            assert _close(r.output_logprobs[b:], by_new[b:])
        else:
            kept = _over_old_cache(old, new, prompt, r.output_token_ids, b)
            assert _close(r.output_logprobs[b:], kept)
            assert not _close(r.output_logprobs[b:], by_new[b:], atol=1e-2)  # the KV matters


async def test_an_idle_keep_swap_applies_at_once(
    backend: LocalBackend, prompts: list[list[int]], perturbed: Path, tiny_model_dir: Path
) -> None:
    before = await backend.generate(GenerateRequest(prompts[1], _greedy(8)))
    await asyncio.wait_for(backend.load_weights(perturbed, 1), 60)
    assert backend.version == 1
    after = await backend.generate(GenerateRequest(prompts[1], _greedy(8)))
    assert (after.policy_version, after.version_starts) == (1, ())
    by_new = _teacher_forced(_model(perturbed), prompts[1], after.output_token_ids)
    assert _close(after.output_logprobs, by_new)
    assert not _close(after.output_logprobs, torch.tensor(before.output_logprobs), atol=1e-2)


async def test_a_closed_backend_refuses_keep_swaps(tiny_model_dir: Path, perturbed: Path) -> None:
    be = LocalBackend(tiny_model_dir)
    await be.close()
    with pytest.raises(BackendError, match="closed"):
        await be.load_weights(perturbed, 1)
    assert be.version == 0


# --- LoRA adapters --------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return {
        "a": make_adapter(tiny_model_dir, root / "a", 1, 4, every),
        "a2": make_adapter(tiny_model_dir, root / "a2", 3, 4, every),
        "b": make_adapter(tiny_model_dir, root / "b", 2, 4, ["q_proj", "v_proj", "down_proj"]),
    }


def _peft(model_dir: Path, adapter: Path) -> torch.nn.Module:
    from peft import PeftModel

    return PeftModel.from_pretrained(_model(model_dir), adapter).eval()


@pytest.mark.parametrize("policy", [KEEP, NO_CLEAR], ids=["clear_kv", "keep_kv"])
async def test_a_keep_adapter_swap_moves_only_that_adapters_rows(
    backend: LocalBackend,
    prompts: list[list[int]],
    tiny_model_dir: Path,
    adapters: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    policy: SwapPolicy,
) -> None:
    """run_a's row goes on with its new adapter from token AT + 1; run_b's row and the base
    row in the same batch decode bit for bit as in the same batch without the swap."""
    await backend.load_adapter("run_a", adapters["a"], 1)
    await backend.load_adapter("run_b", adapters["b"], 5)
    requests = [
        GenerateRequest(prompts[0], _greedy(), adapter="run_a"),
        GenerateRequest(prompts[1], _greedy(), adapter="run_b"),
        GenerateRequest(prompts[2], _greedy()),
    ]
    await asyncio.gather(*(backend.generate(r) for r in requests))  # stores their prefixes
    # the same three rows computed the same way as below: prompts from the prefix cache
    unswapped = await asyncio.gather(*(backend.generate(r) for r in requests))

    async def swap() -> None:
        await backend.load_adapter("run_a", adapters["a2"], 2, policy)

    a, b_row, base = await _swap_after_token(backend, requests, swap, monkeypatch)
    assert backend.adapter_version("run_a") == 2 and backend.version == 0
    assert b_row == unswapped[1] and b_row.policy_version == 5 and b_row.version_starts == ()
    assert base == unswapped[2] and base.version_starts == ()
    b = AT + 1
    assert (a.policy_version, a.version_starts) == (1, ((0, 1), (b, 2)))
    assert len(a.output_token_ids) == N
    assert a.output_token_ids[:b] == unswapped[0].output_token_ids[:b]
    a1_model, a2_model = _peft(tiny_model_dir, adapters["a"]), _peft(tiny_model_dir, adapters["a2"])
    by_a1 = _teacher_forced(a1_model, prompts[0], a.output_token_ids)
    assert _close(a.output_logprobs[:b], by_a1[:b])
    assert not _close(a.output_logprobs[b:], by_a1[b:], atol=1e-2)
    if policy.clear_kv:
        by_a2 = _teacher_forced(a2_model, prompts[0], a.output_token_ids)
        assert _close(a.output_logprobs[b:], by_a2[b:])
    else:
        kept = _over_old_cache(a1_model, a2_model, prompts[0], a.output_token_ids, b)
        assert _close(a.output_logprobs[b:], kept)
