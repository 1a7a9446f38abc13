"""One target of `rlgate bench sample`, run in a process of its own: times the workload.

Run as a script (``python -P sample_target.py TARGET SPEC OUT``), not as a
module, so that ``PYTHONPATH`` alone decides which source tree's `inference`
package is measured: another tree need not contain this file. It therefore
imports nothing of ``rlgate``; only the standard library, torch,
transformers and, for a backend, ``inference.local`` and ``inference.types``.

Targets:

* ``backend``: the `LocalBackend` found on the path; request *i* is
  submitted with `start_stream` at ``gap_s * i`` after the first arrival;
  a request's first and last token are timed as its stream yields them.
* ``generate``: one ``model.generate()`` call on every request at once
  (left-padded, sampled, ``max_new_tokens`` the largest ``max_tokens``); its
  first token is timed when the first decode step's tokens exist (the first
  call of a stopping criterion, which generate makes just after appending
  them), and every row's last token at the call's return.
* ``hardware``: the machine's memory bandwidth (a sum over a tensor far
  larger than the caches) and float32 matmul FLOP/s, best of several each.

SPEC is the JSON `rlgate.bench.sample.write_spec` writes; OUT receives the
raw timings (seconds from the first arrival) that `rlgate.bench.sample`
turns into figures.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

BANDWIDTH_BYTES = 512 * 2**20  # far past any L3 cache
MATMUL_SIZE = 2048
REPEATS = 5


def _best_seconds(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    fn()  # the first call pays one-time costs (page faults, thread pool start)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_hardware(spec: dict[str, Any]) -> dict[str, Any]:
    """Bytes/s read by a sum over `BANDWIDTH_BYTES` and FLOP/s of a square float32 matmul."""
    x = torch.ones(BANDWIDTH_BYTES // 4, dtype=torch.float32)
    read_s = _best_seconds(lambda: x.sum())
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE)
    matmul_s = _best_seconds(lambda: a @ b)
    return {
        "bandwidth_bytes_per_s": BANDWIDTH_BYTES / read_s,
        "matmul_flop_per_s": 2 * MATMUL_SIZE**3 / matmul_s,
    }


async def _drive_backend(backend: Any, spec: dict[str, Any]) -> dict[str, Any]:
    from inference.types import GenerateRequest, SamplingParams

    def request(i: int, max_tokens: int) -> GenerateRequest:
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=spec["seeds"][i])
        return GenerateRequest(spec["prompts"][i], params)

    await backend.generate(request(0, 2))  # warm-up, untimed: every target gets one
    gap = spec["gap_s"]
    t0 = time.perf_counter() + 0.01
    first: list[float] = [0.0] * len(spec["prompts"])
    last: list[float] = [0.0] * len(spec["prompts"])
    tokens: list[int] = [0] * len(spec["prompts"])

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, t0 + gap * i - time.perf_counter()))
        stream = backend.start_stream(request(i, spec["max_tokens"][i]))
        async for _ in stream.tokens():
            if tokens[i] == 0:
                first[i] = time.perf_counter() - t0
            tokens[i] += 1
        last[i] = time.perf_counter() - t0
        await stream.result()

    await asyncio.gather(*(one(i) for i in range(len(spec["prompts"]))))
    return {"first_token_s": first, "last_token_s": last, "tokens": tokens}


def run_backend(spec: dict[str, Any]) -> dict[str, Any]:
    """The workload on the `LocalBackend` of the tree on the path, arrivals `gap_s` apart."""
    import inference.local
    from inference.local import LocalBackend

    async def main() -> dict[str, Any]:
        backend = LocalBackend(
            Path(spec["model_dir"]),
            max_batch_size=spec["max_batch_size"],
            threads=spec["threads"],
        )
        try:
            timings = await _drive_backend(backend, spec)
        finally:
            await backend.close()
        return timings | {"torch_threads": backend.torch_threads}

    out = asyncio.run(main())
    return out | {"source": str(Path(inference.local.__file__).resolve().parents[1])}


def run_generate(spec: dict[str, Any]) -> dict[str, Any]:
    """Every request in one left-padded `model.generate()` call, at time 0."""
    from transformers import (
        AutoModelForCausalLM,
        GenerationConfig,
        StoppingCriteria,
        StoppingCriteriaList,
    )

    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32).eval()
    # No stop token, as the backend's requests have none: every row runs to max_new_tokens.
    # generate falls back to the model's own eos when its config leaves it unset.
    model.generation_config.eos_token_id = None
    pad = model.config.pad_token_id or 0
    prompts = spec["prompts"]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1

    class FirstStep(StoppingCriteria):
        """Records when it is first called: generate calls it once a step's tokens exist."""

        def __init__(self) -> None:
            self.at: float | None = None

        def __call__(self, input_ids: torch.Tensor, scores: Any, **_: Any) -> torch.Tensor:
            if self.at is None:
                self.at = time.perf_counter()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def generate(rows: int, new_tokens: int, hook: FirstStep | None = None) -> torch.Tensor:
        config = GenerationConfig(
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            pad_token_id=pad,
        )
        criteria = StoppingCriteriaList([hook] if hook else [])
        with torch.no_grad():
            return model.generate(
                input_ids=ids[:rows],
                attention_mask=mask[:rows],
                generation_config=config,
                stopping_criteria=criteria,
            )

    torch.manual_seed(spec["seeds"][0])
    generate(1, 2)  # warm-up, untimed: every target gets one
    hook = FirstStep()
    new_tokens = max(spec["max_tokens"])
    t0 = time.perf_counter()
    out = generate(len(prompts), new_tokens, hook)
    end = time.perf_counter() - t0
    if out.shape[1] != width + new_tokens:
        raise RuntimeError(f"generate stopped at {out.shape[1] - width} of {new_tokens} tokens")
    first = (hook.at or t0) - t0
    return {
        "first_token_s": [first] * len(prompts),
        "last_token_s": [end] * len(prompts),
        "tokens": list(spec["max_tokens"]),  # the rows' own; the steps past them are waste
        "torch_threads": torch.get_num_threads(),
    }


TARGETS = {"backend": run_backend, "generate": run_generate, "hardware": measure_hardware}


def main(argv: list[str]) -> int:
    name, spec_path, out_path = argv
    spec = json.loads(Path(spec_path).read_text())
    if spec["threads"] > 0:
        torch.set_num_threads(spec["threads"])
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = TARGETS[name](spec)
    Path(out_path).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
