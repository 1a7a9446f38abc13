"""Where a version's weights come from when a server loads them: a directory, or the trainer.

`weight_sync: disk` (the default): the trainer writes every version's
checkpoint directory and each server reloads from it. `weight_sync:
collective`: the trainer keeps the newest version in memory and offers it
through its weight server (`trainer.weight_server.WeightServer`); next to the
version's checkpoint directory it writes an offer, `v<N>.offer.json`
(`{"url": ..., "version": N}`), and writes the directory itself only every
`save_every_steps` steps, on pause, stop and worker shutdown.

`weights_source` turns what the store records (the checkpoint path) into
what `Backend.load_weights` takes: the directory, or a `CollectiveSource`
when an offer exists. `open_transfer` asks the trainer to open a transfer of
that version to `receivers` ranks; the server then joins it
(`inference.weight_wire.rlgate_weight_wire`). The whole sequence is in
docs/weight-sync.md.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import httpx

from inference.backend import BackendError
from inference.weight_wire.rlgate_weight_wire import Rendezvous

logger = logging.getLogger(__name__)

OFFER_SUFFIX = ".offer.json"
WIRE_DIR = Path(__file__).parent / "weight_wire"  # on an inference server's PYTHONPATH


def offer_path(checkpoint_dir: Path) -> Path:
    """The offer file of the version whose checkpoint directory is (or will be) `checkpoint_dir`."""
    return checkpoint_dir.with_name(checkpoint_dir.name + OFFER_SUFFIX)


def saved(checkpoint_dir: Path) -> bool:
    """Whether the version's weights are on disk (a model or a LoRA adapter: checkpoints are
    renamed into place whole, so any safetensors file means all of them)."""
    return checkpoint_dir.is_dir() and any(checkpoint_dir.glob("*.safetensors"))


@dataclass(frozen=True)
class CollectiveSource:
    """Version `version`'s weights, held by the trainer's weight server at `url`."""

    url: str  # the run's transfers endpoint: POST {url}/transfers
    version: int
    checkpoint_dir: Path  # where the version is saved, if it is (the fallback)

    def __str__(self) -> str:
        return f"{self.url} (v{self.version})"


def weights_source(checkpoint_dir: Path, version: int) -> Path | CollectiveSource:
    """The offer of `version` if the trainer made one, else its checkpoint directory."""
    offer = offer_path(Path(checkpoint_dir))
    try:
        raw = json.loads(offer.read_text())
    except FileNotFoundError:
        return Path(checkpoint_dir)
    except (OSError, ValueError) as exc:
        logger.warning("unreadable offer %s (%s): loading from disk", offer, exc)
        return Path(checkpoint_dir)
    if int(raw.get("version", -1)) != version:
        return Path(checkpoint_dir)
    return CollectiveSource(str(raw["url"]), version, Path(checkpoint_dir))


async def open_transfer(
    source: CollectiveSource,
    receivers: int,
    protocol: str = "rlgate",
    timeout_s: float = 30.0,
    secret: str = "",
) -> tuple[Rendezvous, dict]:
    """Have the trainer open a transfer of `source.version` to `receivers` ranks: its
    `Rendezvous` and the whole answer (protocol "torch", for SGLang, lists the tensors).

    `secret` is the weight server's shared secret (`weight_sync_secret`), sent as
    `Authorization: Bearer`. Raises `BackendError` if the trainer is unreachable, refuses
    the secret (401), or no longer holds that version (it keeps only the newest: 409).
    """
    body = {"version": source.version, "receivers": receivers, "protocol": protocol}
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            resp = await client.post(
                source.url.rstrip("/") + "/transfers", json=body, headers=headers
            )
    except httpx.HTTPError as exc:
        raise BackendError(f"trainer weight server {source.url}: {exc}") from exc
    if resp.status_code != 200:
        raise BackendError(
            f"trainer weight server {source.url} refused v{source.version}: "
            f"{resp.status_code} {resp.text[:300]}"
        )
    answer = resp.json()
    return Rendezvous.from_json(answer), answer
