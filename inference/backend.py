"""The one interface every inference backend implements."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from inference.types import KEEP, GenerateRequest, GenerateResult, SwapPolicy

if TYPE_CHECKING:
    from inference.swap import WeightsSource


class BackendError(Exception):
    """The backend could not serve a request (unavailable, crashed)."""


class BackendOverloaded(BackendError):
    """Too many requests are waiting: the caller should retry a little later."""


class VersionMoved(BackendError):
    """A request that must start on one version (`GenerateRequest.version`) was admitted
    after a swap to another: nothing was sampled; the caller decides again where it goes."""


class TokenStream(Protocol):
    """One streaming generation: its tokens, a way to stop it, and its final result."""

    def tokens(self) -> AsyncIterator[tuple[int, float]]:
        """(token id, logprob) pairs as they are sampled, until generation ends."""
        ...

    def cancel(self) -> None:
        """Stop at the next step; the result then has finish_reason "cancelled"."""
        ...

    async def result(self) -> GenerateResult:
        """The whole sample, as `Backend.generate` would return it (partial if cancelled)."""
        ...


@runtime_checkable
class Backend(Protocol):
    """Token ids in, token ids and logprobs out; weights swappable in place (it is an
    `inference.swap.SwapTarget`: `version` and `load_weights`, the swap's ordering contract).

    Implementations (each kind is registered in `inference.registry`):

    * `inference.local.LocalBackend`: transformers, in the gateway's process (kind "local");
    * `inference.vllm_http.VLLMBackend`: one vLLM server over HTTP (kind "vllm");
    * `inference.sglang_http.SGLangBackend`: one SGLang server over HTTP (kind "sglang");
    * `inference.replicas.ReplicaSet`: several servers of one remote kind behind one
      backend (routing, failover, rolling swap); the gateway wraps every remote run in one.

    The two HTTP backends share `inference.http_backend.HttpBackend` (connection
    pool, admission gate, drain, the swap order and its drain-timeout policy).
    """

    @property
    def version(self) -> int:
        """The policy version currently served."""
        ...

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Sample one completion for `request.prompt_token_ids`."""
        ...

    def start_stream(self, request: GenerateRequest) -> TokenStream:
        """Start sampling; tokens arrive through the returned stream as they are sampled."""
        ...

    async def load_weights(
        self, checkpoint_dir: WeightsSource, version: int, policy: SwapPolicy = KEEP
    ) -> None:
        """Load a checkpoint in place and serve it as `version` from the next request on;
        `policy` says what the requests already generating do (`inference.types.SwapPolicy`).
        """
        ...

    async def health(self) -> bool:
        """True when the backend can take requests."""
        ...

    async def close(self) -> None:
        """Release threads, connections and memory."""
        ...


class InProcessBackend(Backend, Protocol):
    """A backend that runs the model in the gateway's process (kind "local")."""

    @property
    def max_context(self) -> int:
        """The model's context window in tokens."""
        ...


@runtime_checkable
class AdapterBackend(Backend, Protocol):
    """A backend that serves many LoRA adapters on one shared base model.

    A request names its adapter in `GenerateRequest.adapter`; its result's
    `policy_version` is that adapter's version. Swapping one adapter follows
    the same ordering contract as `load_weights` and leaves every other adapter
    and the base weights untouched.
    """

    def adapter_version(self, name: str) -> int | None:
        """The version of adapter `name` now served, or None when it is not loaded."""
        ...

    async def load_adapter(
        self, name: str, adapter_dir: Path, version: int, policy: SwapPolicy = KEEP
    ) -> None:
        """Load (or replace in place) adapter `name` from a PEFT adapter directory.

        The directory holds `adapter_config.json` and `adapter_model.safetensors`.
        Requests generating with the old adapter go on with the new one (`keep`, each
        token labelled with its version) or finish on the old one (`drain`).
        """
        ...

    async def unload_adapter(self, name: str) -> None:
        """Stop serving adapter `name` and free its memory; later requests naming it fail."""
        ...
