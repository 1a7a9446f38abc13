"""The runs list as the dashboard shows it: one row per run, shared by its pages and feeds."""

from __future__ import annotations

from typing import Any

from fastapi import Request


async def runs_summary(request: Request, base_url: str) -> list[dict[str, Any]]:
    """Each run with its status, versions, last rewards (sparkline) and last tokens/s."""
    st = request.app.state
    out = []
    for r in await st.runs.list():
        public = await st.runs.public(r, base_url)
        series = await st.metrics_admin.series(r.id)
        rewards = [p.values["reward_mean"] for p in series.points[-50:]]
        last = series.points[-1].values if series.points else {}
        rewards = [x for x in rewards if x is not None]
        out.append(
            {
                "run_id": r.id,
                "name": r.name,
                "model": r.model,
                "status": r.status,
                "current_version": r.current_version,
                "served_version": public.served_version,
                "rewards": rewards,
                "last_reward": rewards[-1] if rewards else None,
                "tokens_per_s": last.get("tokens_per_s"),
                "steps": len(series.points),
                "created_at": public.created_at,
            }
        )
    return out
