"""Whether a run's training engine can run on this machine, asked without importing the engine.

The gateway asks it at run creation when the trainer worker shares its
machine (the embedded broker); a worker asks it again at step start, since
in production the workers run elsewhere.
"""

from __future__ import annotations

import importlib.util


class EngineUnavailable(RuntimeError):
    """The run's engine cannot run on this machine; the message names the option."""


def engine_unavailable(engine: str) -> str | None:
    """Why `engine` cannot run here (a message naming the option), or None if it can."""
    if engine != "megatron":
        return None  # local and fsdp run anywhere torch does (fsdp on gloo without CUDA)
    if importlib.util.find_spec("megatron") is None or (
        importlib.util.find_spec("megatron.core") is None
    ):
        return (
            "engine='megatron' needs megatron-core, which is not installed: "
            "pip install 'rlgate[megatron]' on the trainer nodes, or use engine='fsdp'"
        )
    import torch

    if not torch.cuda.is_available():
        return (
            "engine='megatron' needs a CUDA device (megatron-core cannot run on CPU): "
            "use engine='fsdp' or engine='local' on this machine"
        )
    return None
