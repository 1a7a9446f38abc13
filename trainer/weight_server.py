"""The trainer's side of `weight_sync: collective`: keep each run's newest weights, send on request.

`WeightServer` holds, per run, a snapshot of the newest version's full
Hugging Face weights (CPU tensors the next step cannot touch) and answers
`POST /runs/{run_id}/transfers {"version", "receivers", "protocol"}` from
the gateway: it opens a gloo rendezvous (`inference.weight_wire.rlgate_weight_wire`;
protocol "rlgate" for rlgate's vLLM worker extension, "torch" for SGLang,
whose answer also lists the tensors), answers it, and broadcasts the
snapshot as rank 0 once the receivers join.

Ordering contract (the whole sequence: docs/weight-sync.md):

- a snapshot is published *before* the version is committed to the store,
  and its offer file (`inference.weight_source.offer_path`) is written before
  that commit too, so the gateway never sees a version it cannot fetch;
- the server keeps only the newest version of a run; a request for any
  other version gets 409, and the gateway then loads that version from disk
  if it was saved, or waits for the next one: a server never gets a version
  other than the one it asked for (the plan carries the version and the
  receiver checks it);
- a transfer reads the snapshot it started with: publishing the next
  version meanwhile replaces the run's entry, not the tensors being sent.

When a version's checkpoint is written, and the offer file that tells the
gateway about the snapshot: `trainer.weight_publish`.

Access: the server listens on `host` only (`weight_sync_host`, loopback by
default; never a wildcard). With a `secret` (`weight_sync_secret`; required
off loopback) every request must carry `Authorization: Bearer <secret>`,
compared in constant time; any other gets 401 before its body is read, and
its connection is closed. The gloo rendezvous a transfer opens (a `TCPStore`
on `host`, a fresh port per transfer) has no authentication of its own: it is
protected by the private network, like vLLM's control endpoints
(docs/security.md).
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast

import torch
from torch import nn

from core.settings import is_loopback
from inference.weight_wire.rlgate_weight_wire import (
    Packed,
    Rendezvous,
    named_rendezvous,
    open_store,
    pack,
    send_tensors,
    send_weights,
    tensor_list,
)

logger = logging.getLogger(__name__)

TRANSFER_PATH = re.compile(r"^/runs/([A-Za-z0-9_.-]+)/transfers$")
TIED = ("lm_head.weight", "model.embed_tokens.weight")
PROTOCOLS = ("rlgate", "torch")  # rlgate's vLLM worker extension; SGLang


class VersionGone(LookupError):
    """The weight server holds another version of the run (or none)."""


def check_bind(host: str, secret: str) -> None:
    """Raise ValueError unless `host` is one interface, and a loopback one if there is no
    secret: a weight server's transfers hand out the policy's weights."""
    if host.strip().strip("[]") in ("", "0.0.0.0", "::"):
        raise ValueError(
            f"weight_sync_host {host!r} is a wildcard: set it to this worker's address on the "
            "private network that the gateway and the inference servers reach it by"
        )
    if not secret and not is_loopback(host):
        raise ValueError(
            f"weight_sync_host {host!r} is not a loopback address: set "
            "RLGATE_WEIGHT_SYNC_SECRET (the same on the worker and the gateway)"
        )


def hf_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s Hugging Face weights, detached (not copied: `WeightServer.publish` packs a
    copy). A tied head is sent once, as the embedding: vLLM's reload skips tied weights."""
    state = model.state_dict()
    head, emb = (state.get(n) for n in TIED)
    if head is not None and emb is not None and head.data_ptr() == emb.data_ptr():
        state.pop(TIED[0])
    return {k: v.detach() for k, v in state.items()}


def distributed_hf_state(engine: Any) -> dict[str, torch.Tensor] | None:
    """An FSDP engine's full weights gathered to global rank 0 (None on the other ranks), as
    CPU copies. Collective: every rank of the group calls it."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # a full state dict holds tensors only; empty off rank 0
    full = cast(dict[str, torch.Tensor], get_model_state_dict(engine.policy, options=opts))
    if dist.get_rank() != 0:
        return None
    state = {k.removeprefix("lm."): v for k, v in full.items()}
    if getattr(engine.policy.lm.config, "tie_word_embeddings", False):
        state.pop(TIED[0], None)
    return {k: v.detach() for k, v in state.items()}  # gathered CPU copies already


class WeightServer:
    """Per run, the newest version's weights, sent to inference servers on request (docstring)."""

    def __init__(self, host: str = "127.0.0.1", timeout_s: float = 600.0, secret: str = "") -> None:
        check_bind(host, secret)
        self.host = host
        self.timeout_s = timeout_s  # a receiver that never joins frees its transfer after this
        # what a request's Authorization header must be; None: no secret (loopback only)
        self.expected = f"Bearer {secret}".encode() if secret else None
        self._snapshots: dict[str, tuple[int, Packed]] = {}
        self._reading: dict[int, int] = {}  # id(Packed) -> transfers sending it now
        self._lock = threading.Lock()
        self.transfers: deque[dict[str, Any]] = deque(maxlen=100)  # the last ones (figures)
        self._httpd = ThreadingHTTPServer((host, 0), _Handler)
        self._httpd.daemon_threads = True
        self._httpd.owner = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="weight-server", daemon=True
        )
        self._thread.start()
        logger.info("weight server at %s", self.url)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self._httpd.server_address[1]}"

    def url_for(self, run_id: str) -> str:
        """What the offer file names: the run's transfers endpoint is `{this}/transfers`."""
        return f"{self.url}/runs/{run_id}"

    def publish(self, run_id: str, version: int, state: dict[str, torch.Tensor]) -> None:
        """Make a copy of `state` (packed in its wire layout) the run's newest version.

        The caller keeps `state` still while this runs (the step is over, under its lock).
        The older snapshot's buffers are reused unless a transfer still reads them; it is
        withdrawn first, so a request for it meanwhile gets 409 as it would a moment later."""
        with self._lock:
            old = self._snapshots.get(run_id)
            spare = old[1] if old is not None and not self._reading.get(id(old[1])) else None
            if spare is not None:
                del self._snapshots[run_id]
        packed = pack(state, into=spare)
        with self._lock:
            self._snapshots[run_id] = (version, packed)

    def version(self, run_id: str) -> int | None:
        with self._lock:
            entry = self._snapshots.get(run_id)
        return None if entry is None else entry[0]

    def forget(self, run_id: str) -> None:
        with self._lock:
            self._snapshots.pop(run_id, None)

    def open(
        self, run_id: str, version: int, receivers: int, protocol: str = "rlgate"
    ) -> dict[str, Any]:
        """Open a transfer of the run's `version` to `receivers` ranks; sending starts at once
        in a thread of its own and waits for them (up to `timeout_s`). Returns the answer:
        the `Rendezvous`, and for protocol "torch" the tensors' names, dtypes and shapes."""
        with self._lock:  # one step with the count: `publish` must not reuse what is read
            entry = self._snapshots.get(run_id)
            if entry is None or entry[0] != version:
                have = None if entry is None else entry[0]
                raise VersionGone(f"run {run_id}: v{version} asked, v{have} held")
            packed = entry[1]
            self._reading[id(packed)] = self._reading.get(id(packed), 0) + 1
        try:
            if protocol == "torch":
                rdv = named_rendezvous(self.host, receivers, version)
                send = partial(send_tensors, rdv, packed, "gloo", self.timeout_s)
                answer = {**rdv.to_json(), "tensors": tensor_list(packed)}
            else:
                store, rdv = open_store(self.host, receivers, version, self.timeout_s)
                send = partial(send_weights, store, rdv, packed, self.timeout_s)
                answer = rdv.to_json()
            threading.Thread(
                target=self._send, args=(run_id, rdv, send, packed), name="weight-send", daemon=True
            ).start()
        except BaseException:
            self._read(packed)
            raise
        return answer

    def _read(self, packed: Packed) -> None:
        """A transfer of `packed` ended."""
        with self._lock:
            left = self._reading.pop(id(packed)) - 1
            if left:
                self._reading[id(packed)] = left

    def _send(self, run_id: str, rdv: Rendezvous, send: Callable[[], int], packed: Packed) -> None:
        t0 = time.perf_counter()
        try:
            nbytes = send()
        except Exception:
            logger.exception("run %s: transfer of v%d failed", run_id, rdv.version)
            return
        finally:
            self._read(packed)
        took = time.perf_counter() - t0
        self.transfers.append(
            {"run_id": run_id, "version": rdv.version, "bytes": nbytes, "seconds": took}
        )
        logger.info(
            "run %s: v%d sent to %d receivers (%d bytes, %.2fs)",
            run_id, rdv.version, rdv.world_size - 1, nbytes, took,
        )  # fmt: skip

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: ThreadingHTTPServer

    def do_GET(self) -> None:
        if self._allowed():
            self._answer(200 if self.path == "/health" else 404, {})

    def do_POST(self) -> None:
        if not self._allowed():
            return
        match = TRANSFER_PATH.match(self.path)
        if match is None:
            self._answer(404, {"error": f"no route {self.path}"})
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            version, receivers = int(body["version"]), int(body["receivers"])
            protocol = str(body.get("protocol", "rlgate"))
            if receivers < 1:
                raise ValueError("receivers must be at least 1")
            if protocol not in PROTOCOLS:
                raise ValueError(f"protocol must be one of {PROTOCOLS}")
        except (ValueError, KeyError, TypeError) as exc:
            self._answer(400, {"error": f"bad transfer request: {exc}"})
            return
        try:
            owner = self.server.owner  # type: ignore[attr-defined]
            answer = owner.open(match.group(1), version, receivers, protocol)
        except VersionGone as exc:
            self._answer(409, {"error": str(exc)})
            return
        self._answer(200, answer)

    def _allowed(self) -> bool:
        """Whether the request carries the secret; if not, it is answered 401 and closed."""
        expected = self.server.owner.expected  # type: ignore[attr-defined]
        given = self.headers.get("Authorization", "").encode()
        if expected is None or hmac.compare_digest(given, expected):
            return True
        logger.warning("weight server: refused %s from %s", self.path, self.client_address[0])
        self.close_connection = True  # nothing of its body is read: the connection is done
        self._answer(401, {"error": "weight server: missing or wrong secret"})
        return False

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, fmt: str, *args: Any) -> None:
        logger.debug("weight server: " + fmt, *args)
