"""One LoRA run's view of a backend that serves many adapters: a `Backend` for that run alone.

The gateway keeps one `RunServing` per run; for a LoRA run its backend is an
`AdapterView` over the shared `AdapterBackend`. Every request it sends names
the run's own adapter (the adapter name is the run id), so a run's traffic is
never sampled with another run's adapter; `load_weights` loads the run's
adapter (the weight sync loop needs no LoRA branch); `version` is the
adapter's. Until the run has trained a version (version 0), no adapter is
loaded and its requests sample the base model, which is what version 0 is.
"""

from __future__ import annotations

import dataclasses

from inference.backend import AdapterBackend, BackendError, TokenStream
from inference.lora import ADAPTER_CONFIG
from inference.swap import WeightsSource, weights_dir
from inference.types import KEEP, GenerateRequest, GenerateResult, SwapPolicy


class AdapterView:
    """The `Backend` of one LoRA run: `backend` with every request routed to adapter `name`.

    `owns_backend`: close the backend with the view (a backend of its own, e.g. a
    remote run's replica set); a shared base is released by its owner instead.
    `base_until_loaded`: while adapter `name` is not loaded, requests sample the base
    model (a run at version 0); False: they name the adapter anyway and fail, for a
    view that must never answer from other weights (a pinned version).
    """

    def __init__(
        self,
        backend: AdapterBackend,
        name: str,
        *,
        owns_backend: bool = False,
        base_until_loaded: bool = True,
    ) -> None:
        self.backend, self.name, self.owns_backend = backend, name, owns_backend
        self.base_until_loaded = base_until_loaded

    @property
    def version(self) -> int:
        loaded = self.backend.adapter_version(self.name)
        return 0 if loaded is None else loaded

    @property
    def torch_threads(self) -> int | None:
        return getattr(self.backend, "torch_threads", None)

    def _route(self, request: GenerateRequest) -> GenerateRequest:
        loaded = self.backend.adapter_version(self.name) is not None
        named = loaded or not self.base_until_loaded
        return dataclasses.replace(request, adapter=self.name if named else None)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return await self.backend.generate(self._route(request))

    def start_stream(self, request: GenerateRequest) -> TokenStream:
        return self.backend.start_stream(self._route(request))

    async def load_weights(
        self, checkpoint_dir: WeightsSource, version: int, policy: SwapPolicy = KEEP
    ) -> None:
        """Load version `version` of this run: its adapter, replacing the one served; `policy`
        says what the run's requests already generating do (`AdapterBackend.load_adapter`)."""
        adapter_dir = weights_dir(checkpoint_dir)
        if not (adapter_dir / ADAPTER_CONFIG).is_file():
            raise BackendError(f"{checkpoint_dir} is not a LoRA adapter of run {self.name}")
        await self.backend.load_adapter(self.name, adapter_dir, version, policy)

    async def health(self) -> bool:
        return await self.backend.health()

    async def close(self) -> None:
        """Unload this run's adapter (the base and every other adapter stay)."""
        try:
            if self.backend.adapter_version(self.name) is not None:
                await self.backend.unload_adapter(self.name)
        finally:
            if self.owns_backend:
                await self.backend.close()
