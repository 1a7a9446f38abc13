"""`rlgate bench swap --stall`: its figures from synthetic measurements, and a smoke run.

The figures (`mode_figures`, `summary`) are pure: fed hand-made calls and swaps, they
must give the stall, gate and throughput figures the docs define. The smoke run drives
the real command against real stand-in servers with a few agents for a few seconds and
checks structure, never speed: every key present, no token emitted inside a pause, no
failed call in keep mode, and in keep mode calls that span a swap (none in drain).
"""

from __future__ import annotations

import json

import pytest

from rlgate import cli
from rlgate.bench.swap_stall import (
    LONG_GAP_S,
    Call,
    ModeRun,
    StallSetup,
    Swap,
    mode_figures,
    summary,
)


def call(
    start: float, first: float, tokens: int, gap: float = 0.02, at: float = 0.0, versions: int = 1
) -> Call:
    """A call whose tokens came every 20 ms, but for one wait of `gap` from `at` on."""
    long_gaps = ((at, at + gap),) if gap > LONG_GAP_S else ()
    return Call(start, first, first + 0.02 * (tokens - 2) + gap, tokens, long_gaps, versions)


def one_swap_run(gap: float, wait: float, tokens: int, failed: int = 0) -> ModeRun:
    """A 20 s mode with one swap over [10, 10.5]: three calls no swap touched (0.05 s to the
    first token, a token every 20 ms, one of them with a 1 s hiccup), one started during the
    swap (`wait` more to its first token), one in flight across it (a wait of `gap`)."""
    calls = [
        call(0.0, 0.05, tokens),
        call(5.0, 5.05, tokens),
        call(1.0, 1.05, tokens, gap=1.0, at=1.5),
        call(10.1, 10.15 + wait, tokens),
        call(8.0, 8.05, tokens, gap=gap, at=10.1, versions=2),
    ]
    calls += [Call(15.0, None, None, 0, (), 1, failed=True) for _ in range(failed)]
    return ModeRun(seconds=20.0, calls=calls, swaps=[Swap(10.0, 10.5, 0.4)], tokens_in_pause=0)


def test_stall_per_swap_is_the_larger_of_admission_wait_and_token_gap() -> None:
    f = mode_figures(one_swap_run(gap=0.38, wait=0.3, tokens=100))
    assert f["admit_wait_ms_max"] == 300.0
    assert f["token_gap_ms_max"] == 360.0  # beyond the usual 20 ms
    assert f["stall_ms"] == f["stall_ms_max"] == 360.0
    assert f["gate_closed_ms"] == 400.0 and f["swap_s"] == 0.5
    assert f["noise_gap_ms_max"] == 1000.0  # the hiccup is no swap's stall
    assert f["tokens_per_s"] == 25.0  # 500 tokens in 20 s
    assert f["spanning_calls"] == 1 and f["failed"] == 0 and f["calls"] == 5

    waited_longer = mode_figures(one_swap_run(gap=0.1, wait=2.0, tokens=100))
    assert waited_longer["stall_ms"] == 2000.0


def test_a_call_outside_every_swap_adds_no_stall() -> None:
    run = one_swap_run(gap=0.02, wait=0.0, tokens=10)
    run.swaps = [Swap(30.0, 30.2, 0.2)]  # no call near it
    f = mode_figures(run)
    assert f["stall_ms"] == 0.0 and f["gate_closed_ms"] == 200.0


def test_summary_sets_keep_against_drain_and_checks_the_targets() -> None:
    setup = StallSetup(reload_ms=300.0)
    runs = {
        "drain": one_swap_run(gap=0.03, wait=3.0, tokens=100),
        "keep": one_swap_run(gap=0.34, wait=0.1, tokens=160),
    }
    out = json.loads(json.dumps(summary(setup, runs)))
    assert out["drain"]["stall_ms"] == 3000.0 and out["keep"]["stall_ms"] == 320.0
    assert out["stall_ratio"] == pytest.approx(320 / 3000, abs=1e-4)
    assert out["throughput_ratio"] == 1.6
    assert out["targets"] == {
        "keep_stall_within_reload_ms_plus_50": True,
        "keep_no_failed_calls": True,
        "keep_throughput_1_5x_drain": True,
        "no_tokens_inside_pauses": True,
    }
    assert "vllm" not in out

    runs["keep"] = one_swap_run(gap=0.5, wait=0.0, tokens=100, failed=2)  # 480 ms > 350
    runs["keep"].tokens_in_pause = None  # a server that does not count them proves nothing
    both = summary(setup, runs, vllm=(setup, runs))
    assert both["vllm"]["keep"] == both["keep"] and both["vllm"]["setup"] == both["setup"]
    missed = both["targets"]
    assert not any(missed.values())


def test_smoke_run_has_every_figure_no_token_in_a_pause_and_no_failure_in_keep(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "swap", "--stall", "--seconds", "3", "--swap-every", "1", "--agents", "3"]
    with pytest.raises(SystemExit) as exit_:
        cli.main([*argv, "--reload-ms", "50", "--think-ms", "100", "--vllm-streams", "0"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert exit_.value.code == 0
    for mode in ("drain", "keep"):
        figures = out[mode]
        assert figures["swaps"] == 2 and figures["failed_swaps"] == 0
        assert figures["tokens_in_pause"] == 0
        assert figures["tokens"] > 0 and figures["calls"] >= 3
        for key in ("stall_ms", "gate_closed_ms", "tokens_per_s", "admit_wait_ms_max"):
            assert key in figures
    assert out["keep"]["failed"] == 0
    assert out["keep"]["spanning_calls"] >= 1  # 4 s streams in a 3 s mode span its swaps
    assert out["drain"]["spanning_calls"] == 0
    assert out["targets"]["no_tokens_inside_pauses"] and out["targets"]["keep_no_failed_calls"]
    assert {"stall_ratio", "throughput_ratio"} <= out.keys()
