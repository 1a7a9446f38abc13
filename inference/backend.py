"""The one interface every inference backend implements."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from inference.types import GenerateRequest, GenerateResult


class BackendError(Exception):
    """The backend could not serve a request (unavailable, overloaded, crashed)."""


@runtime_checkable
class Backend(Protocol):
    """Token ids in, token ids and logprobs out; weights swappable in place.

    Implementations: `inference.local.LocalBackend` (transformers, in-process).
    """

    @property
    def version(self) -> int:
        """The policy version currently served."""
        ...

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Sample one completion for `request.prompt_token_ids`."""
        ...

    async def load_weights(self, checkpoint_dir: Path, version: int) -> None:
        """Load a checkpoint in place and serve it as `version` from the next request on.

        Requests already generating finish on the weights they started with.
        """
        ...

    async def health(self) -> bool:
        """True when the backend can take requests."""
        ...

    async def close(self) -> None:
        """Release threads, connections and memory."""
        ...
