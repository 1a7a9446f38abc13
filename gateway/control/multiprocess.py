"""Several gateway processes on one store: runs may sample only from remote inference servers.

An in-process backend (`local`) loads the run's model into the process that
serves it, so N gateway processes would hold N copies of it and train
against N diverging hot swaps. With `gateway_workers > 1` a run of an
in-process kind is refused where it is created and where it would be served;
vLLM or SGLang servers, shared by every process, serve instead.
"""

from __future__ import annotations

from gateway.admin.runs import RunService
from gateway.control.backends import BackendPool
from gateway.errors import APIError, InvalidRequest, Unavailable
from gateway.protocol import RunCreate, RunCreated
from inference import registry


def refuse_in_process(backend: str, error: type[APIError]) -> None:
    """Raise `error` if `backend` is a known kind that runs inside the gateway process."""
    if backend in registry.names() and not registry.get(backend).remote:
        raise error(
            f"backend {backend!r} loads the model inside each gateway process, and this "
            "gateway runs several (gateway_workers > 1): use "
            f"{' or '.join(registry.remote_names())} servers, or run one gateway process "
            "(rlgate up --workers 1)",
            param="backend",
            code="in_process_backend",
        )


class RemoteOnlyPool(BackendPool):
    """A `BackendPool` that never loads an in-process backend."""

    def _check_kind(self, backend: str) -> None:
        refuse_in_process(backend, Unavailable)


class RemoteOnlyRuns(RunService):
    """A `RunService` that refuses to create runs of an in-process backend."""

    async def create(self, body: RunCreate, base_url: str) -> RunCreated:
        refuse_in_process(body.backend, InvalidRequest)
        return await super().create(body, base_url)
