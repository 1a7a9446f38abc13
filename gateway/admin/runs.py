"""Runs: create (resolve the model, mint the agent key), read, list, with their steps."""

from __future__ import annotations

import asyncio
import builtins
import uuid
from pathlib import Path

from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from core.store.completions import call_stats
from core.store.models import ApiKey, PolicyVersion, Run, RunReplica
from core.store.replicas import replica_urls
from core.store.runs import list_runs, policy_runs
from core.store.steps import run_steps
from gateway.control.backends import BackendPool
from gateway.control.run_replicas import normalize_url, public_replicas
from gateway.errors import Conflict, InvalidRequest, NotFound
from gateway.keys import display_prefix, hash_key, new_key
from gateway.protocol import RunCreate, RunCreated, RunPublic, TrainStepPublic
from gateway.protocol_admin import PolicyCreate
from gateway.rows import from_row
from inference import registry
from inference.lora import missing_lora_targets
from inference.models import resolve_model
from trainer.config import PolicySpec, RunConfig
from trainer.submit import engine_unavailable


def new_run(run_id: str, body: RunCreate, model_dir: Path, cfg: RunConfig) -> Run:
    return Run(
        id=run_id,
        name=body.name,
        model=body.model,
        model_path=str(model_dir),
        backend=body.backend,
        status="active",
        config=cfg.model_dump(),
        current_version=0,
        counters={},
    )


def policy_configs(cfg: RunConfig) -> dict[str, RunConfig]:
    """Each declared policy's configuration, in declaration order (none: an empty dict)."""
    return {name: cfg.policy_config(name) for name in cfg.policies or {}}


class RunService:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        pool: BackendPool,
        models_dir: Path,
        local_trainer: bool = False,
    ) -> None:
        self.sessions = sessions
        self.pool = pool
        self.models_dir = models_dir
        # the trainer worker shares this machine (embedded broker): its engine can be checked here
        self.local_trainer = local_trainer

    async def create(self, body: RunCreate, base_url: str) -> RunCreated:
        try:
            cfg = RunConfig.model_validate(body.config)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = "config." + ".".join(str(p) for p in first["loc"]) if first["loc"] else "config"
            if not first["loc"]:  # a cross-field check: its message starts with the option
                option = str(first.get("ctx", {}).get("error", "")).split(" ", 1)[0].rstrip(":")
                param = f"config.{option}" if option in RunConfig.model_fields else param
            raise InvalidRequest(f"{param}: {first['msg']}", param=param) from exc
        if self.local_trainer and (reason := engine_unavailable(cfg.engine)):
            raise InvalidRequest(f"config.engine: {reason}", param="config.engine")
        try:
            model_dir = await asyncio.to_thread(resolve_model, body.model, self.models_dir)
        except (ValueError, RuntimeError) as exc:
            raise InvalidRequest(str(exc), param="model") from exc
        for target_cfg in [cfg, *policy_configs(cfg).values()]:
            if target_cfg.lora:
                await self._check_lora_targets(model_dir, body.model, target_cfg)
        if cfg.weight_sync == "collective" and body.backend not in registry.remote_names():
            raise InvalidRequest(
                f"config.weight_sync: 'collective' sends weights to inference servers: "
                f"it needs backend {' or '.join(registry.remote_names())}",
                param="config.weight_sync",
            )
        if body.replicas and body.backend not in registry.remote_names():
            kinds = " or ".join(registry.remote_names())
            raise InvalidRequest(f"replicas need backend {kinds}", param="replicas")
        urls = list(dict.fromkeys(normalize_url(u, "replicas") for u in body.replicas))
        run_id = "run_" + uuid.uuid4().hex[:16]
        key = new_key()
        async with self.sessions.begin() as s:
            run = new_run(run_id, body, model_dir, cfg)
            s.add(run)
            await s.flush()
            s.add(ApiKey(run_id=run_id, prefix=display_prefix(key), key_hash=hash_key(key)))
            s.add(PolicyVersion(run_id=run_id, version=0, checkpoint_path=str(model_dir)))
            s.add_all(RunReplica(run_id=run_id, url=u) for u in urls)
            await self._add_policies(s, run, policy_configs(cfg), urls)
        public = await self.public(run, base_url)
        return RunCreated(**public.model_dump(), api_key=key)

    async def _check_lora_targets(self, model_dir: Path, model: str, cfg: RunConfig) -> None:
        missing = await asyncio.to_thread(
            missing_lora_targets, model_dir, cfg.resolved_lora_targets()
        )
        if missing:
            raise InvalidRequest(
                f"config.lora_target_modules: {model} has no Linear layer named "
                f"{', '.join(missing)}",
                param="config.lora_target_modules",
            )

    async def add_policy(self, run_id: str, body: PolicyCreate) -> Run:
        """A policy added to a live run that declares policies: the run's config gains it
        and its run is created, served from the agents' next call (docs/policies.md)."""
        async with self.sessions() as s:
            parent = await s.get(Run, run_id)
        if parent is None:
            raise NotFound(f"no run {run_id!r}", param="run_id")
        cfg = RunConfig.model_validate(parent.config)
        if not cfg.policies:
            raise InvalidRequest(
                f"run {run_id!r} declares no policies: a run is created with its policies",
                code="run_without_policies",
            )
        if body.name in cfg.policies:
            raise Conflict(f"run {run_id!r} has a policy {body.name!r} already", param="name")
        spec = PolicySpec.model_validate(body.model_dump(exclude={"name"}))
        try:
            new_cfg = RunConfig.model_validate(
                parent.config | {"policies": {**cfg.policies, body.name: spec}}
            )
        except ValidationError as exc:
            raise InvalidRequest(str(exc.errors()[0]["msg"]), param=body.name) from exc
        policy_cfg = new_cfg.policy_config(body.name)
        await self._check_lora_targets(Path(parent.model_path), parent.model, policy_cfg)
        async with self.sessions.begin() as s:
            parent = await s.get_one(Run, run_id, with_for_update=True)
            if body.name in (parent.config.get("policies") or {}):
                raise Conflict(f"run {run_id!r} has a policy {body.name!r} already", param="name")
            parent.config = new_cfg.model_dump()
            urls = await replica_urls(s, run_id)
            child = (await self._add_policies(s, parent, {body.name: policy_cfg}, urls))[0]
        return child

    @staticmethod
    async def _add_policies(
        s: AsyncSession, parent: Run, configs: dict[str, RunConfig], urls: builtins.list[str]
    ) -> builtins.list[Run]:
        """A run for each policy (docs/policies.md): the parent's model, backend and
        replicas, the policy's configuration; no key of its own (the parent's keys pick it)."""
        children = []
        for name, cfg in configs.items():
            child = Run(
                id="run_" + uuid.uuid4().hex[:16],
                name=f"{parent.name}/{name}",
                model=parent.model,
                model_path=parent.model_path,
                backend=parent.backend,
                status=parent.status,  # a policy follows its run (paused, stopped)
                config=cfg.model_dump(),
                current_version=0,
                counters={},
                parent_id=parent.id,
                policy=name,
            )
            s.add(child)
            await s.flush()
            s.add(PolicyVersion(run_id=child.id, version=0, checkpoint_path=parent.model_path))
            s.add_all(RunReplica(run_id=child.id, url=u) for u in urls)
            children.append(child)
        return children

    async def public(self, run: Run, base_url: str) -> RunPublic:
        serving = self.pool.loaded().get(run.id)
        async with self.sessions() as s:
            links, drift = await call_stats(s, run.id)
            urls = await replica_urls(s, run.id)
        return from_row(
            RunPublic,
            run,
            run_id=run.id,
            base_url=base_url,
            served_version=serving.backend.version if serving else None,
            replicas=public_replicas(urls, self.pool.replica_status(run.id)),
            counters=run.counters or {},
            calls_by_link=links,
            template_drift=drift,
            created_at=run.created_at.isoformat(),
        )

    TRANSITIONS = {"pause": ("active", "paused"), "resume": ("paused", "active")}

    async def set_status(self, run_id: str, action: str) -> str:
        """pause (active -> paused), resume (paused -> active), stop (any -> stopped, final).

        Pausing freezes the run where it is (no step trains, agent calls get 429), a LoRA
        run's adapter included. Stopping a LoRA run also unloads its adapter, after the
        batch generating now; the shared base and every other run's adapter stay.
        """
        status = await self._set_status(run_id, action)
        if status == "stopped":
            async with self.sessions() as s:
                runs = [await s.get_one(Run, run_id), *await policy_runs(s, run_id)]
            for run in runs:
                if RunConfig.model_validate(run.config).lora:
                    await self.pool.unload(run.id)
        return status

    async def _set_status(self, run_id: str, action: str) -> str:
        async with self.sessions.begin() as s:
            run = await s.get(Run, run_id)
            if run is None:
                raise NotFound(f"no run {run_id!r}", param="run_id")
            if action == "stop":
                run.status = "stopped"
            elif action in self.TRANSITIONS:
                before, after = self.TRANSITIONS[action]
                if run.status != before:
                    raise Conflict(
                        f"cannot {action} a run that is {run.status}", code="invalid_transition"
                    )
                run.status = after
            else:
                raise NotFound(f"no action {action!r}: pause, resume or stop", param="action")
            for child in await policy_runs(s, run_id):  # a run's policies follow it
                child.status = run.status
            return run.status

    async def get(self, run_id: str) -> Run:
        async with self.sessions() as s:
            run = await s.get(Run, run_id)
        if run is None:
            raise NotFound(f"no run {run_id!r}", param="run_id")
        return run

    async def list(self) -> list[Run]:
        async with self.sessions() as s:
            return await list_runs(s)

    async def steps(self, run_id: str) -> builtins.list[TrainStepPublic]:  # `list` is a method here
        await self.get(run_id)
        async with self.sessions() as s:
            rows = await run_steps(s, run_id)
            return [TrainStepPublic.model_validate(r) for r in rows]
