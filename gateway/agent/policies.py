"""Which run serves a call: the key's run, or one of its policies (docs/policies.md).

A run that declares `policies` (`RunConfig.policies`) serves no call itself: each
policy is a run of its own (its LoRA adapter, versions, steps, and its turns of
each episode) under the declaring run, which holds the agent keys. A call names
its policy in `model`: the run's exact name, model or id selects the first
declared policy; otherwise the part after the last `/` names one
(`"<run name>/<policy>"`, as `/v1/models` lists them).

The policies' runs of a parent are read together and cached for the key cache's
time to live (`RunKeyCache.ttl_s`), and dropped with it on every admin write, so a
policy added to a live run is served from the next call.
"""

from __future__ import annotations

import asyncio
import time

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from core.store.models import Run
from core.store.runs import policy_runs
from gateway.errors import NotFound


def declared_policies(run: Run) -> list[str]:
    """The names of the run's policies, in declaration order (none: an empty list)."""
    return list((run.config or {}).get("policies") or {})


def policy_named(run: Run, model: str) -> str | None:
    """The policy a call's `model` names on the key's `run`; None: the run has none and
    `model` names the run itself. 404 (OpenAI's `model_not_found`) for anything else."""
    names = declared_policies(run)
    if model in (run.name, run.model, run.id):
        return names[0] if names else None
    name = model.rpartition("/")[2]
    if name in names:
        return name
    served = [f"{run.name}/{n}" for n in names] or [run.name]
    raise NotFound(
        f"model {model[:200]!r} is not served for this key; use {' or '.join(map(repr, served))}",
        param="model",
        code="model_not_found",
    )


class PolicyRuns:
    """The runs of each parent's policies, by policy name, cached for `ttl_s`."""

    def __init__(self, sessions: async_sessionmaker[AsyncSession], ttl_s: float = 1.0) -> None:
        self.sessions = sessions
        self.ttl_s = ttl_s
        self._entries: dict[str, tuple[dict[str, Run], float]] = {}
        self._loads: dict[str, asyncio.Future[dict[str, Run]]] = {}

    async def of(self, parent_id: str) -> dict[str, Run]:
        """Policy name -> its run, for the parent run `parent_id`."""
        entry = self._entries.get(parent_id)
        if entry is not None and time.monotonic() < entry[1]:
            return entry[0]
        load = self._loads.get(parent_id)
        if load is None:  # concurrent misses of one parent share one read
            load = asyncio.ensure_future(self._load(parent_id))
            self._loads[parent_id] = load
            load.add_done_callback(lambda _: self._loads.pop(parent_id, None))
        return await asyncio.shield(load)

    async def _load(self, parent_id: str) -> dict[str, Run]:
        async with self.sessions() as s:
            runs = {r.policy: r for r in await policy_runs(s, parent_id) if r.policy}
        if self.ttl_s > 0:
            self._entries[parent_id] = (runs, time.monotonic() + self.ttl_s)
        return runs

    def invalidate(self) -> None:
        self._entries.clear()
        self._loads.clear()

    async def serving_run(self, run: Run, model: str) -> Run:
        """The run that serves a call made with the key of `run` for `model`."""
        name = policy_named(run, model)
        if name is None:
            return run
        child = (await self.of(run.id)).get(name)
        if child is None:  # declared, and its run not created yet: as unknown
            raise NotFound(
                f"policy {name!r} of run {run.name!r} is not served yet",
                param="model",
                code="model_not_found",
            )
        return child

    async def family(self, run: Run) -> list[str]:
        """The ids of the runs whose turns may share an episode with `run`'s: its parent's
        policies' runs, or `run` alone."""
        if run.parent_id is None:
            return [run.id]
        return [r.id for r in (await self.of(run.parent_id)).values()] or [run.id]
