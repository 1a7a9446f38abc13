"""The figures of `rlgate bench gateway`, from its measured loads: ratios, fractions, lines.

`results[mode][target]` is a target's entry of what `rlgate.bench.load.measure_together`
returns (``latency`` at a few clients, ``throughput`` per level, ``max_rps`` the best 2xx rate).
Targets: ``stub``, ``litellm`` (unless skipped), one rlgate per
``--workers`` count (``rlgate`` for the first, ``rlgate_w<N>`` for the others)
and, with ``--baseline-src``, ``rlgate_baseline``: the gateway of another
source tree, with the first count. Every rate counts 2xx answers only.
"""

from __future__ import annotations

from typing import Any

OVERLOAD_LEVEL = 512  # the level whose 2xx rate, against the best, is `r512_fraction`
BASELINE = "rlgate_baseline"  # the target of `--baseline-src`


def target_name(workers: int, first: int) -> str:
    """The target of an rlgate gateway with `workers` processes (`first`: the baseline count)."""
    return "rlgate" if workers == first else f"rlgate_w{workers}"


def _statuses(m: dict[str, Any], key: str) -> int:
    return m["latency"][key] + sum(level[key] for level in m["throughput"])


def _gateway_figures(r: dict[str, Any], name: str, lite: bool) -> dict[str, Any]:
    """One gateway's figures in one mode: against the stub, LiteLLM and its own best level."""
    m, stub = r[name], r["stub"]
    floor = stub["latency"]["p50_ms"]
    added = m["latency"]["p50_ms"] - floor
    top = max(m["throughput"], key=lambda level: level["concurrency"])
    p50 = m["latency"]["p50_ms"]
    out: dict[str, Any] = {
        "max_rps": m["max_rps"],
        "added_p50_ms": round(added, 2),
        "p99_over_p50": round(m["latency"]["p99_ms"] / p50, 2) if p50 else None,
        "stub_fraction": round(m["max_rps"] / stub["max_rps"], 3) if stub["max_rps"] else None,
        "top_level": top["concurrency"],
        "top_level_fraction": round(top["rps"] / m["max_rps"], 3) if m["max_rps"] else None,
        "status_429": _statuses(m, "status_429"),
        "status_5xx": _statuses(m, "status_5xx"),
        "status_5xx_at_top": top["status_5xx"],
    }
    if lite:
        lite_added = r["litellm"]["latency"]["p50_ms"] - floor
        out["overhead_ratio"] = round(added / lite_added, 3) if lite_added > 0 else None
        lite_rps = r["litellm"]["max_rps"]
        out["throughput_ratio"] = round(m["max_rps"] / lite_rps, 2) if lite_rps else None
    return out


def mode_figures(r: dict[str, Any], workers: list[int], lite: bool) -> dict[str, Any]:
    """A mode's contract figures (rlgate with `workers[0]` processes) and the other counts'."""
    first = _gateway_figures(r, target_name(workers[0], workers[0]), lite)
    out: dict[str, Any] = {"rlgate_added_p50_ms": first.pop("added_p50_ms"), **first}
    if lite:
        lite_added = r["litellm"]["latency"]["p50_ms"] - r["stub"]["latency"]["p50_ms"]
        out["litellm_added_p50_ms"] = round(lite_added, 2)
    if out["top_level"] == OVERLOAD_LEVEL:
        out["r512_fraction"] = out["top_level_fraction"]
    if len(workers) > 1:
        out["workers"] = {}
        for w in workers[1:]:
            other = _gateway_figures(r, target_name(w, workers[0]), lite)
            base = out["max_rps"]
            other[f"vs_workers_{workers[0]}"] = round(other["max_rps"] / base, 2) if base else None
            out["workers"][str(w)] = other
    if BASELINE in r:
        base = _gateway_figures(r, BASELINE, lite)
        base["rlgate_max_rps_over_this"] = (
            round(out["max_rps"] / base["max_rps"], 2) if base["max_rps"] else None
        )
        base["rlgate_added_p50_over_this"] = (
            round(out["rlgate_added_p50_ms"] / base["added_p50_ms"], 3)
            if base["added_p50_ms"] > 0
            else None
        )
        out["baseline"] = base
    return out


def summary(
    results: dict[str, dict[str, Any]],
    workers: list[int],
    stored: dict[str, dict[str, int]],
    lite: bool,
    **meta: Any,
) -> dict[str, Any]:
    """The bench's JSON: per-mode figures, the contract's top level (plain), the storage check.

    `stored` maps a target to ``{"answered": 2xx answers, "stored": completions in the DB,
    "episodes": its run's episodes}``.
    """
    out: dict[str, Any] = {"bench": "gateway", **meta, "workers": workers}
    out["rlgate_answered"] = sum(s["answered"] for s in stored.values())
    out["rlgate_stored"] = sum(s["stored"] for s in stored.values())
    out["stored_by_target"] = stored
    out["modes"] = results
    for mode, r in results.items():
        out[mode] = mode_figures(r, workers, lite)
    if "plain" in out:  # the contract's top-level figures: the non-streaming token-id mode
        for key in ("overhead_ratio", "throughput_ratio", "stub_fraction", "r512_fraction"):
            if key in out["plain"]:
                out[key] = out["plain"][key]
    if "stream" in out:
        out["stream_p99_over_p50"] = out["stream"]["p99_over_p50"]
    out["status_5xx"] = sum(out[mode]["status_5xx"] for mode in results)
    out["all_stored"] = all(s["stored"] >= s["answered"] for s in stored.values())
    return out


def load_line(mode: str, name: str, m: dict[str, Any]) -> str:
    """One measured load, for the terminal: 2xx rate with the 429s and 5xx beside it."""
    head = f"{mode:6} {name:10} c={m['concurrency']:<4} 2xx {m['rps']:8.1f} req/s  "
    if not m["answers"] and not m["errors"]:
        return head + "no answer within the window (every request took longer)"
    line = head + (
        f"429 {m['status_429']:<6} 5xx {m['status_5xx']:<5} other errors "
        f"{m['errors'] - m['status_429'] - m['status_5xx']:<5} "
        f"p50 {m['p50_ms']:8.2f} ms  p99 {m['p99_ms']:8.2f} ms"
    )
    if "rounds" in m:  # the figures above are the rounds' medians
        line += "  rounds " + " ".join(f"{r['rps']:.1f}" for r in m["rounds"])
    return line


def figure_lines(out: dict[str, Any]) -> list[str]:
    """The per-mode figures, one line each, then the storage check."""
    lines = []
    for mode in out["modes"]:
        figures = {k: v for k, v in out[mode].items() if k not in ("workers", "baseline")}
        lines.append(f"{mode}: " + ", ".join(f"{k} {v}" for k, v in figures.items()))
        others = {f"--workers {w}": f for w, f in out[mode].get("workers", {}).items()}
        if "baseline" in out[mode]:
            others["baseline"] = out[mode]["baseline"]
        for label, other in others.items():
            text = ", ".join(f"{k} {v}" for k, v in other.items())
            lines.append(f"{mode} {label}: {text}")
    lines.append(f"rlgate answered {out['rlgate_answered']} (2xx), stored {out['rlgate_stored']}")
    return lines
