"""`rlgate bench swap --stall`: what a hot swap costs the agents, `drain` against `keep`.

Agents drive the backend client the gateway itself forwards to (`VLLMBackend`,
one per server), not a gateway: 64 streams on 2 cores leave no CPU for a
gateway in between, and the swap's cost lives in the backend's gate and the
server's pause, which the gateway only passes on. Each agent streams one
generation after another (a random pause of up to `think_ms` between calls,
none by default) until the mode's time is up; the agents start spread over
one generation's length. A swapper calls `load_weights(..., policy)` every
`swap_every_s`, alternating two checkpoints. Both modes run in the same
process against fresh servers with the same settings, drain first.

Two setups:

* the stand-in server (`inference.stub_server`): `agents` streams of
  `tokens` tokens at `token_ms` a token; a reload holds the paused server for
  `reload_ms` (the stand-in reloads instantly, so the client waits that long
  between pause and reload: the agents see what a reload of that length does);
* the vLLM CPU build with SmolLM2 (`--vllm-streams`): a few long streams, its
  own reload time.

Per mode (`mode_figures`): the stall per swap, the larger of the longest
added admission wait of a call started during the swap (its time to first
token less the median of calls no swap touched) and the longest added wait
between two tokens of a stream across the swap (a wait that overlaps it, less
the median time per token of those calls); the longest wait between tokens
that overlaps no swap (`noise_gap_ms_max`: the machine's own hiccups); the
time the backend's
gate was closed (a probe enters the admission gate every `PROBE_S` during a
swap; its longest wait); failed calls; tokens/s over the whole mode; calls
that span two versions; and, from the stand-in's `/stub/state`, tokens
emitted while the server was paused (must be 0). `summary` puts keep and
drain side by side with ratios and the targets.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inference.backend import BackendError
from inference.types import DRAIN, KEEP, GenerateRequest, SamplingParams, SwapPolicy
from inference.vllm_http import VLLMBackend

logger = logging.getLogger(__name__)

POLICIES: dict[str, SwapPolicy] = {"drain": DRAIN, "keep": KEEP}
PROBE_S = 0.002  # how often the gate probe tries the admission gate during a swap
LONG_GAP_S = 0.05  # a call records each wait between two tokens longer than this
KEEP_STALL_MARGIN_MS = 50.0  # target: keep's stall per swap <= reload + this
THROUGHPUT_TARGET = 1.5  # target: keep tokens/s >= this x drain's (stand-in setup)
# The `/stub/state` counter of tokens emitted while the server was paused.
PAUSED_TOKEN_KEY = "tokens_while_paused"


@dataclass(frozen=True)
class StallSetup:
    """One setup's fixed parameters (the stand-in's defaults are the published figures)."""

    agents: int = 64  # concurrent streams, each one generation after another
    tokens: int = 200  # max_tokens of every generation
    token_ms: float = 20.0  # the stand-in's time per token (vLLM: its own)
    swap_every_s: float = 10.0  # a swap starts this often from the mode's start
    seconds: float = 120.0  # per mode
    reload_ms: float = 300.0  # the stand-in's reload; vLLM: its own (0 here)
    think_ms: float = 0.0  # an agent waits uniform [0, think_ms] between two calls

    @property
    def stagger_s(self) -> float:
        """Agent n starts n * this after the first: spread over one generation's length."""
        return self.tokens * self.token_ms / 1000 / max(self.agents, 1)


@dataclass(frozen=True)
class Call:
    """One agent call, in seconds of the mode's clock (`perf_counter`)."""

    start: float
    first: float | None  # first token's arrival (None: none arrived)
    last: float | None  # last token's arrival
    tokens: int  # tokens received before the mode's end
    gaps: tuple[tuple[float, float], ...]  # (from, to) of each wait between tokens > LONG_GAP_S
    versions: int  # versions that sampled it (1 unless it spans a keep swap)
    failed: bool = False


@dataclass(frozen=True)
class Swap:
    start: float
    end: float  # load_weights returned
    gate_closed: float  # the gate probe's longest wait during the swap
    failed: bool = False


@dataclass
class ModeRun:
    """What one mode measured; `mode_figures` turns it into figures."""

    seconds: float
    calls: list[Call] = field(default_factory=list)
    swaps: list[Swap] = field(default_factory=list)
    tokens_in_pause: int | None = None  # the stand-in's counter; None: not reported


def _ms(seconds: float) -> float:
    return round(1000 * seconds, 1)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _baselines(run: ModeRun) -> tuple[float, float]:
    """Median time to first token and median time per token of the calls no swap touched."""

    def touched(c: Call) -> bool:
        last = c.last or c.start
        return any(s.start <= c.start <= s.end or c.start < s.start < last for s in run.swaps)

    calm = [c for c in run.calls if c.first is not None and c.last is not None and not touched(c)]
    first = _median([c.first - c.start for c in calm if c.first is not None])
    per_token = _median(
        [(c.last - c.first) / (c.tokens - 1) for c in calm if c.first and c.last and c.tokens > 1]
    )
    return first, per_token


def swap_stalls(run: ModeRun) -> list[tuple[float, float]]:
    """Per swap, in seconds: the longest added wait for the first token of a call started
    during it, and the longest added wait between two tokens of a stream across it (a wait
    that overlaps the swap); "added": less the median of calls no swap touched."""
    base_first, base_token = _baselines(run)
    stalls = []
    for s in run.swaps:
        waits = [
            c.first - c.start - base_first
            for c in run.calls
            if c.first is not None and s.start <= c.start <= s.end
        ]
        gaps = [
            b - a - base_token for c in run.calls for a, b in c.gaps if a < s.end and b > s.start
        ]
        stalls.append((max([0.0, *waits]), max([0.0, *gaps])))
    return stalls


def noise_gap(run: ModeRun) -> float:
    """The longest wait between two tokens that overlaps no swap (the machine's own hiccups)."""
    return max(
        [0.0]
        + [
            b - a
            for c in run.calls
            for a, b in c.gaps
            if not any(a < s.end and b > s.start for s in run.swaps)
        ]
    )


def mode_figures(run: ModeRun) -> dict[str, Any]:
    """The figures of one mode (milliseconds, tokens/s, counts)."""
    stalls = swap_stalls(run)
    per_swap = [max(pair) for pair in stalls] or [0.0]
    gate = [s.gate_closed for s in run.swaps] or [0.0]
    return {
        "swaps": len(run.swaps),
        "failed_swaps": sum(s.failed for s in run.swaps),
        "stall_ms": _ms(statistics.median(per_swap)),
        "stall_ms_max": _ms(max(per_swap)),
        "admit_wait_ms_max": _ms(max([0.0, *(w for w, _ in stalls)])),
        "token_gap_ms_max": _ms(max([0.0, *(g for _, g in stalls)])),
        "noise_gap_ms_max": _ms(noise_gap(run)),
        "gate_closed_ms": _ms(statistics.median(gate)),
        "gate_closed_ms_max": _ms(max(gate)),
        "swap_s": round(statistics.median([s.end - s.start for s in run.swaps] or [0.0]), 3),
        "calls": len(run.calls),
        "failed": sum(c.failed for c in run.calls),
        "spanning_calls": sum(c.versions > 1 for c in run.calls),
        "tokens": sum(c.tokens for c in run.calls),
        "tokens_per_s": round(sum(c.tokens for c in run.calls) / run.seconds, 1),
        "tokens_in_pause": run.tokens_in_pause,
    }


def _side_by_side(figures: dict[str, dict[str, Any]]) -> dict[str, Any]:
    drain, keep = figures["drain"], figures["keep"]
    return {
        **figures,
        "stall_ratio": round(keep["stall_ms"] / drain["stall_ms"], 4)
        if drain["stall_ms"]
        else None,
        "throughput_ratio": (
            round(keep["tokens_per_s"] / drain["tokens_per_s"], 3)
            if drain["tokens_per_s"]
            else None
        ),
    }


def summary(
    setup: StallSetup,
    stub: dict[str, ModeRun],
    vllm: tuple[StallSetup, dict[str, ModeRun]] | None = None,
) -> dict[str, Any]:
    """The bench's JSON: each mode's figures, keep against drain, and the targets (on the
    stand-in setup); `vllm`: the vLLM setup and its runs, side by side too."""
    out = _side_by_side({mode: mode_figures(run) for mode, run in stub.items()})
    keep, drain = out["keep"], out["drain"]
    paused = [f["tokens_in_pause"] for f in (keep, drain)]
    result: dict[str, Any] = {
        "bench": "swap",
        "mode": "stall",
        "setup": dataclasses.asdict(setup),
        **out,
        "targets": {
            "keep_stall_within_reload_ms_plus_50": keep["stall_ms_max"]
            <= setup.reload_ms + KEEP_STALL_MARGIN_MS,
            "keep_no_failed_calls": keep["failed"] == 0,
            "keep_throughput_1_5x_drain": (out["throughput_ratio"] or 0) >= THROUGHPUT_TARGET,
            "no_tokens_inside_pauses": all(n == 0 for n in paused),
        },
    }
    if vllm is not None:
        vllm_setup, vllm_runs = vllm
        figures = {mode: mode_figures(run) for mode, run in vllm_runs.items()}
        result["vllm"] = {"setup": dataclasses.asdict(vllm_setup), **_side_by_side(figures)}
    return result


# --- measuring ------------------------------------------------------------------------------


class SlowReload(VLLMBackend):
    """`VLLMBackend` whose reload keeps the (paused) server paused `reload_s` longer: the
    stand-in reloads instantly, a real server does not."""

    reload_s = 0.0

    async def _reload(self, checkpoint_dir: Path, version: int) -> None:
        await asyncio.sleep(self.reload_s)
        await super()._reload(checkpoint_dir, version)


async def _agent(
    backend: VLLMBackend, n: int, setup: StallSetup, run: ModeRun, stop_at: float
) -> None:
    """One agent: streams one generation after another until `stop_at`."""
    think = random.Random(n)
    await asyncio.sleep(n * setup.stagger_s)
    i = 0
    while (start := time.perf_counter()) < stop_at:
        i += 1
        prompt = [1 + n % 97, 2 + i % 89, 3, 4 + n]
        params = SamplingParams(max_tokens=setup.tokens, temperature=1.0, seed=n * 100_003 + i)
        first: float | None = None
        last, tokens, versions, failed = start, 0, 1, False
        gaps: list[tuple[float, float]] = []
        try:
            stream = backend.start_stream(GenerateRequest(prompt, params))
            async for _ in stream.tokens():
                now = time.perf_counter()
                if now > stop_at:
                    stream.cancel()
                    break
                if first is None:
                    first = now
                elif now - last > LONG_GAP_S:
                    gaps.append((last, now))
                last, tokens = now, tokens + 1
            versions = len((await stream.result()).spans)
        except BackendError as exc:
            logger.warning("agent %d: call failed: %s", n, exc)
            failed = True
        run.calls.append(
            Call(start, first, last if tokens else None, tokens, tuple(gaps), versions, failed)
        )
        if setup.think_ms:
            await asyncio.sleep(think.uniform(0, setup.think_ms / 1000))


async def _gate_probe(backend: VLLMBackend, waits: list[float], done: asyncio.Event) -> None:
    """Enter and leave the admission gate every PROBE_S until `done`; record each entry's
    wait (the entry under way when `done` is set still completes: the gate opens at the end)."""
    while not done.is_set():
        t0 = time.perf_counter()
        async with backend.admitted():
            pass
        waits.append(time.perf_counter() - t0)
        await asyncio.sleep(PROBE_S)


async def _swapper(
    backend: VLLMBackend,
    policy: SwapPolicy,
    checkpoints: tuple[Path, Path],
    setup: StallSetup,
    run: ModeRun,
    t0: float,
) -> None:
    version = backend.version
    k = 1
    while (at := t0 + k * setup.swap_every_s) < t0 + setup.seconds:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        version, k = version + 1, k + 1
        waits: list[float] = []
        done = asyncio.Event()
        probe = asyncio.create_task(_gate_probe(backend, waits, done))
        start, failed = time.perf_counter(), False
        try:
            await backend.load_weights(checkpoints[version % 2], version, policy)
        except BackendError as exc:
            logger.warning("swap to v%d failed: %s", version, exc)
            failed = True
        end = time.perf_counter()
        done.set()
        await probe
        run.swaps.append(Swap(start, end, max([0.0, *waits]), failed))


async def _tokens_in_pause(url: str) -> int | None:
    """The stand-in's count of tokens emitted while paused (None: it reports none)."""
    import httpx

    async with httpx.AsyncClient(base_url=url) as client:
        resp = await client.get("/stub/state")
    paused = resp.json().get(PAUSED_TOKEN_KEY) if resp.status_code == 200 else None
    return None if paused is None else int(paused)


async def measure_mode(
    url: str,
    policy: SwapPolicy,
    setup: StallSetup,
    checkpoints: tuple[Path, Path],
    stub: bool,
) -> ModeRun:
    """Agents and swaps against the server at `url` for `setup.seconds`."""
    backend = SlowReload.for_url(url)
    backend.reload_s = setup.reload_ms / 1000
    run = ModeRun(seconds=setup.seconds)
    try:
        await backend.generate(GenerateRequest([1, 2, 3], SamplingParams(max_tokens=1)))
        t0 = time.perf_counter()
        stop_at = t0 + setup.seconds
        agents = [
            asyncio.create_task(_agent(backend, n, setup, run, stop_at))
            for n in range(setup.agents)
        ]
        await _swapper(backend, policy, checkpoints, setup, run, t0)
        await asyncio.gather(*agents)
        if stub:
            run.tokens_in_pause = await _tokens_in_pause(url)
    finally:
        await backend.close()
    return run


@contextlib.contextmanager
def stub_server(setup: StallSetup, log: Path) -> Iterator[str]:
    """A fresh stand-in vLLM server with the setup's token rate; yields its URL."""
    from inference.launch import wait_ready
    from rlgate.stack import free_port, stop

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "inference.stub_server",
        "--flavor=vllm",
        f"--port={port}",
        f"--token-latency-ms={setup.token_ms}",
        f"--output-tokens={setup.tokens}",
    ]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, timeout_s=60, poll_s=0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


def stub_checkpoints(work: Path) -> tuple[Path, Path]:
    """Two checkpoint directories the stand-in accepts (it reads nothing from them)."""
    dirs = (work / "stub-a", work / "stub-b")
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        (d / "model.safetensors").touch()
    return dirs


def run_stub(setup: StallSetup, work: Path) -> dict[str, ModeRun]:
    """Both modes against fresh stand-in servers with the same settings."""
    checkpoints = stub_checkpoints(work)
    runs = {}
    for mode, policy in POLICIES.items():
        with stub_server(setup, work / f"stub-{mode}.log") as url:
            runs[mode] = asyncio.run(measure_mode(url, policy, setup, checkpoints, stub=True))
        print(f"stand-in {mode}: {_line(mode_figures(runs[mode]))}", flush=True)
    return runs


def run_vllm(args: argparse.Namespace, setup: StallSetup, work: Path) -> dict[str, ModeRun]:
    """Both modes against the vLLM CPU build serving SmolLM2 (one server, restarted per mode)."""
    from core.settings import Settings
    from inference.launch import ServerConfig, running_server
    from inference.models import resolve_model
    from rlgate.bench import dirs as bench_dirs
    from rlgate.bench.swap import perturbed_checkpoint
    from rlgate.inference_cli import server_python
    from rlgate.stack import free_port

    settings = Settings()
    base = resolve_model(args.vllm_model, bench_dirs.model_cache(args.cache_dir))
    other = work / "ckpt-b"
    if not other.exists():
        perturbed_checkpoint(base, other)
    runs = {}
    for mode, policy in POLICIES.items():
        cfg = ServerConfig(
            kind="vllm",
            model_dir=base,
            python=server_python("vllm", args.python, settings),
            port=free_port(),
            max_model_len=args.max_model_len,
        )
        with running_server(cfg, work / f"vllm-{mode}.log", timeout_s=900):
            runs[mode] = asyncio.run(measure_mode(cfg.url, policy, setup, (base, other), False))
        print(f"vLLM {mode}: {_line(mode_figures(runs[mode]))}", flush=True)
    return runs


def _line(f: dict[str, Any]) -> str:
    return (
        f"stall/swap {f['stall_ms']:.0f} ms (max {f['stall_ms_max']:.0f}), gate closed "
        f"{f['gate_closed_ms']:.0f} ms, failed {f['failed']}, {f['tokens_per_s']:.0f} tokens/s, "
        f"{f['spanning_calls']} calls span a swap, tokens in pauses {f['tokens_in_pause']}"
    )


def setups(args: argparse.Namespace) -> tuple[StallSetup, StallSetup]:
    """The stand-in's setup and vLLM's (a few long streams, a swap every 15 s) from the CLI."""
    stub = StallSetup(
        agents=args.agents,
        seconds=args.seconds,
        swap_every_s=args.swap_every,
        reload_ms=args.reload_ms,
        think_ms=args.think_ms,
    )
    vllm = StallSetup(
        agents=args.vllm_streams,
        seconds=args.vllm_seconds,
        swap_every_s=args.vllm_swap_every,
        token_ms=0.0,  # the model's own pace
        reload_ms=0.0,  # the server's own reload
    )
    return stub, vllm


def run(args: argparse.Namespace) -> int:
    """Both setups, both modes; exit 1 if a token came out of a paused server or keep failed."""
    import json

    from rlgate.bench import dirs as bench_dirs

    stub_setup, vllm_setup = setups(args)
    with bench_dirs.work_dir("swap-stall", args.work_dir) as work:
        stub = run_stub(stub_setup, work)
        vllm = (vllm_setup, run_vllm(args, vllm_setup, work)) if vllm_setup.agents else None
    result = summary(stub_setup, stub, vllm)
    for name, met in result["targets"].items():
        print(f"target {name}: {'met' if met else 'NOT met'}")
    print(
        f"keep vs drain: stall ratio {result['stall_ratio']}, "
        f"throughput ratio {result['throughput_ratio']}"
    )
    print(json.dumps(result))
    targets = result["targets"]
    return 0 if targets["no_tokens_inside_pauses"] and targets["keep_no_failed_calls"] else 1
