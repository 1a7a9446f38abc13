"""`swap_s` of `rlgate bench train --engine fsdp`: a new version into vLLM, from disk or over gloo.

One vLLM CPU server (float32, eager, rlgate's worker extension) serves the
model; this process plays the trainer, holding the model in memory. Each
repeat moves every weight a little (a new version N+1), then hands it over
both ways, alternating which goes first:

- disk: the trainer writes version N+1's checkpoint as the FSDP engine does
  (`trainer.hf_io.write_untied_hf`: full weights, untied head, tokenizer
  files), then `VLLMBackend.load_weights(dir)`: pause, `reload_weights`
  from the directory, resume;
- collective: the trainer snapshots the weights (`trainer.weight_server.hf_state`)
  and offers them (`WeightServer.publish`, an offer file), then
  `VLLMBackend.load_weights(CollectiveSource)`: pause, the server's worker
  joins a gloo transfer and reloads in place, resume.

`swap_s` is the median, per mode, of the seconds from "the trainer holds N+1
in memory" to "the server serves N+1"; `swap_trainer_s` is the trainer's part
(write, or snapshot), `swap_bytes` what each mode moves. After the last
swap the server's greedy tokens must be the trainer's own (float32 transformers).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any


def bench_swap(model_dir: Path, work: Path, repeats: int) -> dict[str, Any]:
    """Median seconds per weight-sync mode for one new version into a vLLM CPU server."""
    import torch
    from transformers import AutoModelForCausalLM

    from core.store.checkpoints import CheckpointLayout
    from inference.launch import ServerConfig, install_vllm, running_server
    from inference.types import GenerateRequest, SamplingParams
    from inference.vllm_http import VLLMBackend
    from inference.weight_source import CollectiveSource
    from rlgate.stack import free_port
    from trainer.hf_io import write_untied_hf
    from trainer.weight_publish import write_offer
    from trainer.weight_server import WeightServer, hf_state

    python = install_vllm(log=work / "vllm-install.log")
    cfg = ServerConfig(
        kind="vllm", model_dir=model_dir, python=python, port=free_port(), max_model_len=512
    )
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    layout = CheckpointLayout(work)
    server = WeightServer()
    seconds: dict[str, list[float]] = {"disk": [], "collective": []}
    trainer_s: dict[str, list[float]] = {"disk": [], "collective": []}
    nbytes: dict[str, int] = {}
    greedy = GenerateRequest([1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=8, temperature=0.0))

    def disk(version: int) -> tuple[Any, float]:
        t0 = time.perf_counter()
        out = layout.attempt_dir("bench", version)
        write_untied_hf(lm.state_dict(), lm.config, lm.generation_config, out, model_dir)
        nbytes["disk"] = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        return out, time.perf_counter() - t0

    def collective(version: int) -> tuple[Any, float]:
        t0 = time.perf_counter()
        state = hf_state(lm)
        server.publish("bench", version, state)
        out = layout.attempt_dir("bench", version)
        write_offer(out, server.url_for("bench"), version)
        nbytes["collective"] = sum(t.numel() * t.element_size() for t in state.values())
        return CollectiveSource(server.url_for("bench"), version, out), time.perf_counter() - t0

    async def swaps() -> list[int]:
        backend = VLLMBackend.for_url(cfg.url)
        version = 0
        try:
            for i in range(repeats + 1):  # the first round warms both paths up, and is dropped
                order = ("disk", "collective") if i % 2 == 0 else ("collective", "disk")
                for mode in order:
                    with torch.no_grad():
                        for p in lm.parameters():
                            p.mul_(1.0 + 1e-3)  # a new version: every weight moved
                    version += 1
                    t0 = time.perf_counter()
                    source, spent = disk(version) if mode == "disk" else collective(version)
                    await backend.load_weights(source, version)
                    if i > 0:
                        seconds[mode].append(time.perf_counter() - t0)
                        trainer_s[mode].append(spent)
            return (await backend.generate(greedy)).output_token_ids
        finally:
            await backend.close()

    try:
        with running_server(cfg, work / "vllm.log", timeout_s=900):
            served = asyncio.run(swaps())
    finally:
        server.close()
    ids = torch.tensor([greedy.prompt_token_ids])
    with torch.no_grad():
        out = lm.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False
        )
    expected = out[0, ids.shape[1] :].tolist()
    if served != expected[: len(served)]:
        raise RuntimeError(f"vLLM serves other weights than the trainer's: {served} != {expected}")

    result = swap_figures(seconds, trainer_s, nbytes)
    swap, part = result["swap_s"], result["swap_trainer_s"]
    print(f"weight swap into vLLM CPU ({model_dir.name}, float32, median of {repeats}):")
    for mode in ("disk", "collective"):
        print(
            f"  {mode}: {swap[mode]:.3f} s (trainer's part {part[mode]:.3f} s, "
            f"{nbytes[mode] / 1e6:.1f} MB)"
        )
    print(f"  collective / disk: {result['swap_ratio']:.2f}")
    return result


def swap_figures(
    seconds: dict[str, list[float]], trainer_s: dict[str, list[float]], nbytes: dict[str, int]
) -> dict[str, Any]:
    """The `swap_s` part of the bench's JSON: median seconds per mode (`disk`, `collective`)."""
    swap = {mode: statistics.median(s) for mode, s in seconds.items()}
    return {
        "swap_s": swap,
        "swap_trainer_s": {mode: statistics.median(s) for mode, s in trainer_s.items()},
        "swap_bytes": nbytes,
        "swap_ratio": swap["collective"] / swap["disk"],
    }
