"""`rlgate bench gateway` end to end, short: stub and a real gateway on PostgreSQL."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from rlgate.bench.gateway import add_arguments, bench_gateway

from .conftest import PG_ADMIN

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def short_bench(
    work_dir: Path,
    cache_dir: Path,
    loader: str,
    modes: tuple[str, ...],
    rounds: int = 2,
    extra: tuple[str, ...] = (),
) -> dict:
    """The bench as `rlgate bench gateway` runs it, with short loads at one level."""
    argv = ["--database-url", PG_ADMIN, "--cache-dir", str(cache_dir), "--work-dir", str(work_dir)]
    argv += ["--seconds", "1", "--warmup", "1", "--latency-concurrency", "2", "--levels", "8"]
    argv += ["--rounds", str(rounds), "--skip-litellm", "--load-generator", loader]
    argv += ["--modes", ",".join(modes), *extra]
    return bench_gateway(add_arguments(argparse.ArgumentParser()).parse_args(argv))


def test_every_mode_through_rlgate_is_answered_and_stored(
    model_cache_dir: Path, tmp_path: Path
) -> None:
    out = short_bench(tmp_path, model_cache_dir, "python", ("plain", "stream", "chat"))
    for mode in ("plain", "stream", "chat"):
        rlgate = out["modes"][mode]["rlgate"]
        for load in (rlgate["latency"], *rlgate["throughput"]):
            assert load["requests"] > 0 and load["errors"] == 0, (mode, load)
        # two rounds at the one level, summed into its counts (and so into the stored check)
        (level,) = rlgate["throughput"]
        assert len(level["rounds"]) == 2 and level["requests"] > 0
        assert out[mode]["status_5xx"] == 0 and "overhead_ratio" not in out[mode]
        assert out[mode]["top_level"] == 8 and "r512_fraction" not in out[mode]
    assert "Traceback" not in (tmp_path / "gateway-w1.log").read_text()
    assert out["all_stored"], out["stored_by_target"]
    assert out["rlgate_stored"] >= out["rlgate_answered"] > 0
    assert out["litellm_version"] is None and out["workers"] == [1]


@pytest.mark.wrk
def test_chat_mode_opens_an_episode_per_request(model_cache_dir: Path, tmp_path: Path) -> None:
    out = short_bench(tmp_path, model_cache_dir, "wrk", ("chat",))
    stored = out["stored_by_target"]["rlgate"]
    assert stored["answered"] > 10 and out["all_stored"]
    # wrk's request() numbered the episode paths: one episode per answered request at least
    assert stored["episodes"] >= stored["answered"]


def test_a_baseline_tree_is_up_beside_the_gateway_and_both_are_stored(
    model_cache_dir: Path, tmp_path: Path
) -> None:
    """`--baseline-src`: a second gateway (this tree again) up at once, on its own database,
    loaded in lockstep with the first; each answered and stored what it answered."""
    src = str(Path(__file__).resolve().parents[2])
    out = short_bench(tmp_path, model_cache_dir, "python", ("plain",), 1, ("--baseline-src", src))
    for name in ("rlgate", "rlgate_baseline"):
        m = out["modes"]["plain"][name]
        for load in (m["latency"], *m["throughput"]):
            assert load["requests"] > 0 and load["errors"] == 0, (name, load)
        assert out["stored_by_target"][name]["answered"] > 0
    assert out["plain"]["baseline"]["rlgate_max_rps_over_this"] > 0
    assert out["all_stored"], out["stored_by_target"]
    for log in ("gateway-w1.log", "gateway-w1-baseline.log"):
        assert "Traceback" not in (tmp_path / log).read_text()
