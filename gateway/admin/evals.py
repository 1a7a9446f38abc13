"""A run's held-out figures for the admin API (`core.store.evals` computes them)."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from core.store.evals import eval_figures
from core.store.models import Run
from gateway.errors import NotFound
from gateway.protocol_admin import EvalFiguresList, EvalRow, EvalSpanning


class EvalAdmin:
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self.sessions = sessions

    async def figures(self, run_id: str) -> EvalFiguresList:
        """One row per version with a scored evaluation episode; the spanning ones apart."""
        async with self.sessions() as s:
            if await s.get(Run, run_id) is None:
                raise NotFound(f"no run {run_id!r}", param="run_id")
            rows = await eval_figures(s, run_id)
        data = [
            EvalRow(
                version=r.version, episodes=r.episodes, mean_reward=r.mean_reward, stderr=r.stderr
            )
            for r in rows
            if r.version is not None
        ]
        spanning = next(
            (
                EvalSpanning(episodes=r.episodes, mean_reward=r.mean_reward, stderr=r.stderr)
                for r in rows
                if r.version is None
            ),
            None,
        )
        return EvalFiguresList(run_id=run_id, data=data, spanning=spanning)
