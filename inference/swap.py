"""The one swap protocol: how a run's serving takes a new policy version in place.

Every backend kind is a `SwapTarget` (`inference.backend.Backend` declares it):
the in-process `LocalBackend`, one HTTP server's client (`HttpBackend`), a
`ReplicaSet` of them and a LoRA run's `AdapterView` (an adapter lane on a
shared base). The control plane never swaps a backend directly: each loaded
run has one `Swapper`, chosen when the run is loaded from the process's
`ServerSwaps` (built once at start-up). `InPlaceSwap` calls the target's
`load_weights`; the multi-process barrier (`gateway.control.swap_barrier`) is
another `Swapper` around the same replica set.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import ClassVar, Protocol

from inference.backend import Backend
from inference.types import KEEP, SwapPolicy
from inference.weight_source import CollectiveSource

WeightsSource = Path | CollectiveSource  # a checkpoint directory, or the trainer's offer


def weights_dir(source: WeightsSource) -> Path:
    """The checkpoint directory of `source` (an in-process backend reads only from disk)."""
    return source.checkpoint_dir if isinstance(source, CollectiveSource) else Path(source)


class SwapTarget(Protocol):
    """Something that serves one policy version and loads the next one in place."""

    @property
    def version(self) -> int:
        """The policy version served now (what a request admitted now will record)."""
        ...

    async def load_weights(
        self, checkpoint_dir: WeightsSource, version: int, policy: SwapPolicy = KEEP
    ) -> None:
        """Load `version` in place and serve it from the next request on.

        `policy` (`inference.types.SwapPolicy`): `keep`, requests already generating go
        on with `version` from their next token and record where it began; `drain`, they
        finish on the weights they started with while new requests wait.
        """
        ...


class Quiescible(SwapTarget, Protocol):
    """`load_weights` in its steps apart, so that several clients of the same servers (other
    gateway processes) can agree on one reload: quiesce, reload or adopt, reopen."""

    def quiesced(self, what: str, policy: SwapPolicy = KEEP) -> AbstractAsyncContextManager[None]:
        """The gate closed until exit; with `drain`, also none of this client's requests in
        flight (with `keep` they go on and are paused by the server's reload)."""
        ...

    async def reload_quiesced(
        self, source: WeightsSource, version: int, policy: SwapPolicy = KEEP
    ) -> None:
        """Reload the server(s) behind and label later requests (and, with `keep`, the rest
        of those in flight) `version`; the caller is quiesced with the same `policy`."""
        ...


class SharedServer(Quiescible, Protocol):
    """A client of one server that other clients also hold."""

    # True when the server labels each token with the weights version that sampled it,
    # so the requests of clients that did not reload are versioned exactly in a keep swap.
    labels_tokens: ClassVar[bool]

    def set_version(self, version: int) -> None:
        """Label later requests `version` without reloading (another client loaded it)."""
        ...


class ServerClient(Backend, SharedServer, Protocol):
    """The backend of one remote server (`HttpBackend`): what a remote kind connects to."""

    async def served_context(self) -> int | None:
        """The server's own context limit (vLLM's --max-model-len), if it reports one."""
        ...


class Swapper(Protocol):
    """One run's hot swap in this process.

    Ordering contract. The trainer commits version N+1 (checkpoint written or
    offered, `runs.current_version` bumped, step done) in one transaction before
    the swap loop sees it. `swap(source, N+1, policy)` then serves N+1 to every
    request admitted after it; the run's `SwapPolicy` says what happens to
    those already generating:

    * `keep` (the default): they pause between two tokens while the weights
      change and go on with N+1; new requests wait only for the reload itself.
      Every token records the version that sampled it (the result's
      `version_starts`); a completion's `policy_version` is its oldest token's.
    * `drain`: new requests wait while those in flight finish on N, then the
      weights change; every completion is sampled by one version.

    Each backend kind closes its admission for the reload (or, in process,
    swaps between two decode steps), loads, and only then bumps the version
    it labels tokens with. Between the commit and the swap new completions are
    still sampled by N (at most one version behind; the staleness bound counts
    them).

    A replica set rolls N+1 across its servers one at a time, so until the
    roll ends completions from different servers may carry N or N+1, each
    labelled with its own. A LoRA run swaps only its adapter, in the same
    order; the base and other runs' adapters stay. With several gateway
    processes on one store the barrier swapper closes every process's gate
    (and, with `drain`, drains it) before one of them reloads each server once.
    """

    @property
    def version(self) -> int:
        """The version this process's clients of the run label results with."""
        ...

    async def check(self) -> None:
        """Before each pass: restore what the next swap relies on (a no-op unless shared)."""
        ...

    async def swap(self, source: WeightsSource, version: int, policy: SwapPolicy = KEEP) -> None:
        """Bring the run to `version` (contract above); raises if a server failed to load."""
        ...

    async def close(self) -> None:
        """This process stops serving the run (the backend is closed by its owner)."""
        ...


async def _nothing() -> None:
    return None


class InPlaceSwap:
    """The swapper of a run this process swaps alone: `target.load_weights`.

    `release`: what `close` gives up beyond the target (a remote LoRA run's
    membership of the barrier of the servers under its adapter).
    """

    def __init__(
        self, target: SwapTarget, release: Callable[[], Awaitable[None]] = _nothing
    ) -> None:
        self.target, self._release = target, release

    @property
    def version(self) -> int:
        return self.target.version

    async def check(self) -> None:
        return None

    async def swap(self, source: WeightsSource, version: int, policy: SwapPolicy = KEEP) -> None:
        await self.target.load_weights(source, version, policy)

    async def close(self) -> None:
        await self._release()


class SharedReplicas(Quiescible, Protocol):
    """A replica set over `SharedServer`s (`ReplicaSet[ServerClient]`), as the barrier
    needs it."""

    def set_versions(
        self, versions: dict[str, int], target: tuple[WeightsSource, int] | None
    ) -> None:
        """Adopt each server's version as another client had it load (by replica name);
        `target`: the weights a returning replica gets."""
        ...

    def versions(self) -> dict[str, int]:
        """The version each server's client labels results with, by replica name."""
        ...


class ServerSwaps(Protocol):
    """How this process takes a remote run's servers into its swaps, chosen at start-up:
    alone (`SoleServerSwaps`) or agreed with other processes (`SwapBarrier`)."""

    async def join(
        self, run_id: str, replicas: SharedReplicas, source: WeightsSource | None, version: int
    ) -> Swapper:
        """`replicas` start serving the run here at `version` (`source`: its weights)."""
        ...

    async def close(self) -> None:
        """Release what every run's swapper shares (connections)."""
        ...


class SoleServerSwaps:
    """One process serves the store: it loads the run's version itself and swaps in place."""

    async def join(
        self, run_id: str, replicas: SharedReplicas, source: WeightsSource | None, version: int
    ) -> Swapper:
        if source is not None:
            await replicas.load_weights(source, version)
        return InPlaceSwap(replicas)

    async def close(self) -> None:
        return None
