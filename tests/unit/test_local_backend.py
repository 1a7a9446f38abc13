"""The in-process transformers backend: batching, stop logic, seeds, and hot swap."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from inference.backend import Backend, BackendError, VersionMoved
from inference.chat_template import ChatTemplate
from inference.local import LocalBackend
from inference.types import (
    DRAIN,
    KEEP,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    SwapPolicy,
)

PROMPTS = [
    [{"role": "user", "content": "what is one plus two?"}],
    [{"role": "user", "content": "hello"}],
    [
        {"role": "system", "content": "reply with only the number."},
        {"role": "user", "content": "the quick brown fox jumps over the lazy dog. 7 8 9"},
    ],
    [{"role": "user", "content": "yes no maybe"}],
]


@pytest.fixture(scope="module")
def template(tiny_model_dir: Path) -> ChatTemplate:
    return ChatTemplate(tiny_model_dir)


@pytest.fixture(scope="module")
def prompts(template: ChatTemplate) -> list[list[int]]:
    return [template.render(m) for m in PROMPTS]


@pytest.fixture
async def backend(tiny_model_dir: Path) -> AsyncIterator[LocalBackend]:
    be = LocalBackend(tiny_model_dir, batch_wait_s=0.05)
    try:
        yield be
    finally:
        await be.close()


@pytest.fixture(scope="module")
def modified_checkpoint(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a rescaled, shifted lm_head: same shapes, different logits."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("ckpt") / "v1"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        head = model.get_output_embeddings().weight
        head.mul_(4.0).add_(torch.randn(head.shape, generator=gen) * 0.05)
    model.save_pretrained(out)
    return out


def _greedy(max_tokens: int = 12, stop: tuple[int, ...] = ()) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=stop)


def _check(result: GenerateResult, params: SamplingParams) -> None:
    assert len(result.output_token_ids) == len(result.output_logprobs) >= 1
    assert len(result.output_token_ids) <= params.max_tokens
    assert all(lp <= 0.0 for lp in result.output_logprobs)


async def test_is_a_backend(backend: LocalBackend) -> None:
    assert isinstance(backend, Backend)
    assert await backend.health()
    assert backend.version == 0
    assert backend.max_context == 1024


async def test_concurrent_requests_are_batched(
    backend: LocalBackend, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes: list[int] = []  # rows that joined together, rows that decoded together
    real_join, real_step = backend._prefill, backend._decode_step

    def join(rows, batch):
        sizes.append(len(rows))
        return real_join(rows, batch)

    def step(batch):
        widths.append(len(batch.rows))
        return real_step(batch)

    widths: list[int] = []
    monkeypatch.setattr(backend, "_prefill", join)
    monkeypatch.setattr(backend, "_decode_step", step)
    params = [
        _greedy(5),
        SamplingParams(max_tokens=9, temperature=1.0, seed=4),
        _greedy(3),
        SamplingParams(max_tokens=7, temperature=0.7, top_p=0.9, seed=5),
        _greedy(11),
        SamplingParams(max_tokens=1, temperature=1.0),
    ]
    reqs = [GenerateRequest(prompts[i % len(prompts)], p) for i, p in enumerate(params)]
    results = await asyncio.gather(*(backend.generate(r) for r in reqs))
    assert sum(sizes) == len(reqs)
    assert max(sizes) > 1, f"no request joined with another: {sizes}"
    assert max(widths) > 1, f"no request decoded with another: {widths}"
    for r, p in zip(results, params, strict=True):
        _check(r, p)
        assert len(r.output_token_ids) == p.max_tokens  # no stop ids given: runs to the limit
        assert r.finish_reason == "length"
        assert r.policy_version == 0


async def test_batched_greedy_equals_unbatched(
    backend: LocalBackend, prompts: list[list[int]]
) -> None:
    """Left padding must not change what a row generates (prompts differ in length)."""
    solo = [await backend.generate(GenerateRequest(p, _greedy(10))) for p in prompts]
    together = await asyncio.gather(
        *(backend.generate(GenerateRequest(p, _greedy(10))) for p in prompts)
    )
    for a, b in zip(solo, together, strict=True):
        assert a.output_token_ids == b.output_token_ids
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-4)


async def test_greedy_matches_a_no_cache_reference(
    backend: LocalBackend, prompts: list[list[int]]
) -> None:
    """KV-cached greedy decoding == argmax of a full forward pass at every step."""
    prompt = prompts[2]
    result = await backend.generate(GenerateRequest(prompt, _greedy(8)))
    ids = list(prompt)
    ref_ids, ref_lps = [], []
    with torch.no_grad():
        for _ in range(8):
            logits = backend.model(input_ids=torch.tensor([ids])).logits[0, -1]
            lp = torch.log_softmax(logits.float(), dim=-1)
            tok = int(lp.argmax())
            ref_ids.append(tok)
            ref_lps.append(float(lp[tok]))
            ids.append(tok)
    assert result.output_token_ids == ref_ids
    assert result.output_logprobs == pytest.approx(ref_lps, abs=1e-4)


async def test_greedy_is_deterministic(backend: LocalBackend, prompts: list[list[int]]) -> None:
    a = await backend.generate(GenerateRequest(prompts[0], _greedy(16)))
    b = await backend.generate(GenerateRequest(prompts[0], _greedy(16)))
    assert backend.prefixes.hits == 1  # b's prompt came from a's cache but its last token
    assert a.output_token_ids == b.output_token_ids
    # computed in another split of the prompt: float32 rounding, not another distribution
    assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-5)


async def test_seed_reproduces_a_sample(backend: LocalBackend, prompts: list[list[int]]) -> None:
    def params(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=16, temperature=1.0, seed=seed)

    a = await backend.generate(GenerateRequest(prompts[0], params(7)))
    b = await backend.generate(GenerateRequest(prompts[0], params(7)))
    c = await backend.generate(GenerateRequest(prompts[0], params(8)))
    assert a.output_token_ids == b.output_token_ids
    assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-6)
    assert a.output_token_ids != c.output_token_ids
    # the same seed gives the same sample when batched with other requests
    others = [GenerateRequest(p, SamplingParams(max_tokens=20)) for p in prompts[1:]]
    batched = await asyncio.gather(
        backend.generate(GenerateRequest(prompts[0], params(7))),
        *(backend.generate(r) for r in others),
    )
    assert batched[0].output_token_ids == a.output_token_ids


async def test_finish_reason_stop_includes_the_stop_token(
    backend: LocalBackend, prompts: list[list[int]]
) -> None:
    free = await backend.generate(GenerateRequest(prompts[0], _greedy(6)))
    assert free.finish_reason == "length"
    assert len(free.output_token_ids) == 6
    third = free.output_token_ids[2]
    first_hit = free.output_token_ids.index(third)
    stopped = await backend.generate(GenerateRequest(prompts[0], _greedy(6, stop=(third,))))
    assert stopped.finish_reason == "stop"
    assert stopped.output_token_ids == free.output_token_ids[: first_hit + 1]
    assert stopped.output_token_ids[-1] == third
    assert stopped.output_logprobs == pytest.approx(free.output_logprobs[: first_hit + 1], abs=1e-5)


async def test_stop_token_on_the_last_allowed_step_is_a_stop(
    backend: LocalBackend, prompts: list[list[int]]
) -> None:
    free = await backend.generate(GenerateRequest(prompts[1], _greedy(4)))
    last = free.output_token_ids[-1]
    n = free.output_token_ids.index(last) + 1
    r = await backend.generate(GenerateRequest(prompts[1], _greedy(n, stop=(last,))))
    assert len(r.output_token_ids) == n
    assert r.finish_reason == "stop"


async def test_a_finished_row_stops_while_its_batch_goes_on(
    backend: LocalBackend, prompts: list[list[int]]
) -> None:
    free = await backend.generate(GenerateRequest(prompts[0], _greedy(1)))
    first = free.output_token_ids[0]
    short, long = await asyncio.gather(
        backend.generate(GenerateRequest(prompts[0], _greedy(12, stop=(first,)))),
        backend.generate(GenerateRequest(prompts[0], _greedy(12))),
    )
    assert short.output_token_ids == [first] and short.finish_reason == "stop"
    assert len(long.output_token_ids) == 12 and long.finish_reason == "length"
    assert long.output_token_ids[0] == first


async def test_load_weights_swaps_version_and_logits(
    backend: LocalBackend, prompts: list[list[int]], modified_checkpoint: Path, tiny_model_dir: Path
) -> None:
    req = GenerateRequest(prompts[0], _greedy(8))
    before = await backend.generate(req)
    assert before.policy_version == 0

    await backend.load_weights(modified_checkpoint, 1)
    assert backend.version == 1
    after = await backend.generate(req)
    assert after.policy_version == 1
    assert after.output_logprobs != pytest.approx(before.output_logprobs, abs=1e-3)

    # swapping the original weights back in reproduces the original numbers exactly
    await backend.load_weights(tiny_model_dir, 2)
    again = await backend.generate(req)
    assert again.policy_version == 2
    assert again.output_token_ids == before.output_token_ids
    assert again.output_logprobs == pytest.approx(before.output_logprobs, abs=1e-6)


async def test_a_request_that_must_start_on_a_swapped_out_version_samples_nothing(
    backend: LocalBackend, prompts: list[list[int]], modified_checkpoint: Path
) -> None:
    """`GenerateRequest.version` is checked where the engine admits the row: a pin of the
    version being served that a swap overtook is refused, never answered by the new one."""
    on_0 = await backend.generate(GenerateRequest(prompts[0], _greedy(4), version=0))
    assert on_0.policy_version == 0
    await backend.load_weights(modified_checkpoint, 1)
    with pytest.raises(VersionMoved, match="v1, not v0"):
        await backend.generate(GenerateRequest(prompts[0], _greedy(4), version=0))
    stream = backend.start_stream(GenerateRequest(prompts[0], _greedy(4), version=0))
    with pytest.raises(VersionMoved):
        async for _ in stream.tokens():
            pass
    on_1 = await backend.generate(GenerateRequest(prompts[0], _greedy(4), version=1))
    assert on_1.policy_version == 1


async def test_requests_queued_before_a_drain_swap_finish_on_the_old_version(
    backend: LocalBackend, prompts: list[list[int]], modified_checkpoint: Path
) -> None:
    old = asyncio.ensure_future(backend.generate(GenerateRequest(prompts[0], _greedy(30))))
    await asyncio.sleep(0)  # the request is queued before the swap
    swap = asyncio.ensure_future(backend.load_weights(modified_checkpoint, 1, DRAIN))
    await asyncio.sleep(0)
    new = asyncio.ensure_future(backend.generate(GenerateRequest(prompts[0], _greedy(4))))
    r_old, _, r_new = await asyncio.gather(old, swap, new)
    assert (r_old.policy_version, r_old.version_starts) == (0, ())
    assert len(r_old.output_token_ids) == 30
    assert r_new.policy_version == 1


@pytest.mark.parametrize("policy", [KEEP, DRAIN], ids=["keep", "drain"])
async def test_failed_swap_keeps_serving_the_old_weights(
    backend: LocalBackend,
    prompts: list[list[int]],
    tmp_path: Path,
    tiny_model_dir: Path,
    policy: SwapPolicy,
) -> None:
    req = GenerateRequest(prompts[0], _greedy(5))
    before = await backend.generate(req)
    with pytest.raises(BackendError):
        await backend.load_weights(tmp_path, 1, policy)  # no safetensors there
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    from safetensors.torch import save_file

    for f in broken.glob("*.safetensors"):
        save_file({"lm_head.weight": torch.zeros(3, 3)}, f)
    with pytest.raises(BackendError):
        await backend.load_weights(broken, 1, policy)
    assert backend.version == 0
    after = await backend.generate(req)
    assert after.policy_version == 0
    assert after.output_logprobs == pytest.approx(before.output_logprobs, abs=1e-6)


@pytest.mark.parametrize("policy", [KEEP, DRAIN], ids=["keep", "drain"])
async def test_partially_matching_checkpoint_leaves_the_weights_untouched(
    backend: LocalBackend,
    prompts: list[list[int]],
    tmp_path: Path,
    tiny_model_dir: Path,
    policy: SwapPolicy,
) -> None:
    from safetensors.torch import load_file, save_file

    state = {k: v * 2 for k, v in load_file(tiny_model_dir / "model.safetensors").items()}
    del state["lm_head.weight"]  # e.g. a checkpoint with a shard missing
    save_file(state, tmp_path / "model.safetensors")
    req = GenerateRequest(prompts[0], _greedy(5))
    before = await backend.generate(req)
    with pytest.raises(BackendError):
        await backend.load_weights(tmp_path, 1, policy)
    after = await backend.generate(req)
    assert after.policy_version == 0
    assert after.output_logprobs == pytest.approx(before.output_logprobs, abs=1e-6)


async def test_closed_backend_refuses_work(tiny_model_dir: Path, prompts: list[list[int]]) -> None:
    be = LocalBackend(tiny_model_dir)
    await be.close()
    assert not await be.health()
    with pytest.raises(BackendError):
        await be.generate(GenerateRequest(prompts[0], _greedy(2)))


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": 1e-45},  # logits / t overflow to inf and NaN probabilities
        {"temperature": float("nan")},
        {"seed": 2**70},  # beyond what torch.Generator.manual_seed accepts
        {"top_p": 0.0},
        {"max_tokens": 0},
    ],
)
def test_bad_sampling_params_are_refused_before_batching(bad: dict) -> None:
    # Refused at construction, so a bad request can never join (and fail) a batch.
    with pytest.raises(ValueError):
        SamplingParams(**bad)


async def test_a_valid_neighbour_is_unaffected_by_a_refused_request(
    backend: LocalBackend, prompts: list[list[int]]
) -> None:
    good_req = GenerateRequest(prompts[1], _greedy(4))
    results = await asyncio.gather(
        backend.generate(GenerateRequest([], _greedy(4))),  # empty prompt: refused up front
        backend.generate(good_req),
        return_exceptions=True,
    )
    assert isinstance(results[0], BackendError)
    assert not isinstance(results[1], BaseException)
    assert results[1].policy_version == 0
