"""`ChatService.config`: a run's config is validated once per Run object and config dict."""

from __future__ import annotations

from types import SimpleNamespace

from sqlalchemy.ext.asyncio import async_sessionmaker

from core.store.models import Run
from gateway.agent.completions import ChatService
from trainer.config import RunConfig


def _service() -> ChatService:
    pool = SimpleNamespace(serving_version=lambda run_id: None)
    return ChatService(async_sessionmaker(), pool)  # type: ignore[arg-type]


def test_the_same_run_object_reuses_its_validated_config() -> None:
    chat = _service()
    run = Run(id="r", config=RunConfig(group_size=4).model_dump())
    first = chat.config(run)
    assert first.group_size == 4
    assert chat.config(run) is first


def test_a_new_config_dict_or_run_object_is_validated_again() -> None:
    chat = _service()
    run = Run(id="r", config=RunConfig(group_size=4).model_dump())
    first = chat.config(run)
    run.config = RunConfig(group_size=8).model_dump()  # an admin update through this process
    assert chat.config(run).group_size == 8
    other = Run(id="r", config=run.config)  # the key cache reloaded the run
    assert chat.config(other) is not first and chat.config(other).group_size == 8
