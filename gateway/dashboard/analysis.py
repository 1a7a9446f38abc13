"""Dashboard analysis pages: runs overlaid on shared charts, a group's episodes side by side.

Also the run page's episode filters, read from its query string. Everything
here is a GET whose address is the whole view (a shareable link).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.datastructures import QueryParams

from gateway.dashboard.pages import PagesDep
from gateway.dashboard.summary import runs_summary
from gateway.deps import AgentBaseUrlDep, PageSessionDep

# (series name in the metrics feed, caption, log y axis by default)
RUN_CHARTS = (
    ("reward_mean", "Reward (mean)", False),
    ("loss", "Loss", True),
    ("kl", "KL", True),
    ("entropy", "Entropy", False),
    ("clip_frac", "Clip fraction", False),
    ("staleness_mean", "Staleness (versions)", False),
    ("tokens_per_s", "Tokens/s (train)", False),
)
COMPARE_CHARTS = tuple(c for c in RUN_CHARTS if c[0] != "clip_frac")
# One colour per compared run, in selection order (colour-blind-friendly first).
PALETTE = ("#2f6fed", "#e8590c", "#2b8a3e", "#ae3ec9", "#c92a2a", "#1098ad", "#5c940d", "#862e9c")
MAX_COMPARED = len(PALETTE)

_FILTERS = (
    "status",
    "reward_min",
    "reward_max",
    "version",
    "length_min",
    "length_max",
    "drift",
    "group_id",
)
_PARSE: dict[str, Callable[[str], Any]] = {
    "reward_min": float,
    "reward_max": float,
    "version": int,
    "length_min": int,
    "length_max": int,
}


def _flag(value: str) -> bool:
    if value not in ("true", "false"):
        raise ValueError(f"drift must be true or false, not {value!r}")
    return value == "true"


def episode_filters(query: QueryParams) -> tuple[dict[str, str | None], dict[str, Any]]:
    """The run page's filters as typed (to refill the form) and parsed (for the service).

    Raises ValueError naming the field on a value that is not a number or a flag.
    """
    raw = {k: query.get(k) or None for k in _FILTERS}
    parsed: dict[str, Any] = {}
    for name, value in raw.items():
        if value is None:
            parsed[name] = None
        elif name == "drift":
            parsed[name] = _flag(value)
        elif name in _PARSE:
            try:
                parsed[name] = _PARSE[name](value)
            except ValueError:
                raise ValueError(f"{name} must be a number, not {value!r}") from None
        else:
            parsed[name] = value
    return raw, parsed


router = APIRouter(include_in_schema=False)


@router.get("/compare", dependencies=[PageSessionDep])
async def compare_page(request: Request, base_url: AgentBaseUrlDep, pages: PagesDep) -> Response:
    runs = await runs_summary(request, base_url)
    by_id = {r["run_id"]: r for r in runs}
    wanted = list(dict.fromkeys(request.query_params.getlist("run")))
    unknown = [w for w in wanted if w not in by_id]
    chosen = [by_id[w] for w in wanted if w in by_id][:MAX_COMPARED]
    names = [r["name"] for r in chosen]

    def label(r: dict[str, Any]) -> str:  # two runs of one name are told apart by their ids
        return r["name"] if names.count(r["name"]) == 1 else f"{r['name']} ({r['run_id']})"

    selected = [r | {"color": PALETTE[i], "label": label(r)} for i, r in enumerate(chosen)]
    error = None
    if unknown:
        error = "no run " + ", ".join(repr(u) for u in unknown[:5])
    elif len(wanted) > MAX_COMPARED:
        error = f"at most {MAX_COMPARED} runs at once: the first {MAX_COMPARED} are shown"
    return pages.render(
        request,
        "compare.html",
        runs=runs,
        selected=selected,
        selected_ids={r["run_id"] for r in selected},
        selected_runs=[{k: r[k] for k in ("run_id", "label", "color")} for r in selected],
        compare_charts=COMPARE_CHARTS,
        error=error,
    )


@router.get("/runs/{run_id}/groups/{group_id}", dependencies=[PageSessionDep])
async def group_page(run_id: str, group_id: str, request: Request, pages: PagesDep) -> Response:
    group = await request.app.state.episode_admin.group(run_id, group_id)
    return pages.render(request, "group.html", group=group.model_dump())
