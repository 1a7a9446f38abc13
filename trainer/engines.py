"""The engine registry: which class runs each `RunConfig.engine`, and where it runs.

The one place that maps the `engine` setting to code. `EngineEntry.torchrun`
picks the run's step runner (`trainer.step_runner`): a warm engine inside the
worker, or resident torchrun ranks (`trainer.resident_rank`, which builds
`torchrun_engine(cfg.engine)`). Both get the class from `engine_class` and
build it with `Engine`'s one constructor. Classes are imported only then:
megatron-core is an optional GPU-only extra.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.engine import Engine


@dataclass(frozen=True)
class EngineEntry:
    target: str  # "module:Class"
    torchrun: bool  # True: runs on resident torchrun ranks, not inside the worker


ENGINES: dict[str, EngineEntry] = {
    "local": EngineEntry("trainer.local_engine:LocalEngine", torchrun=False),
    "fsdp": EngineEntry("trainer.fsdp_engine:FsdpEngine", torchrun=True),
    "megatron": EngineEntry("trainer.megatron_engine:MegatronEngine", torchrun=True),
}


def engine_entry(name: str) -> EngineEntry:
    """The registry entry for `name`; a ValueError naming the option if there is none."""
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine={name!r}: one of {', '.join(ENGINES)}") from None


def engine_class(name: str) -> type[Engine]:
    """The class registered as `name`, imported now."""
    module, cls = engine_entry(name).target.split(":")
    return getattr(importlib.import_module(module), cls)


def torchrun_engine(name: str) -> str:
    """The engine torchrun ranks run for a config naming `name`.

    `name` itself when it is a torchrun engine; FSDP for a config left at
    `engine='local'` that is launched on ranks anyway (tests, the bench).
    """
    return name if engine_entry(name).torchrun else "fsdp"
