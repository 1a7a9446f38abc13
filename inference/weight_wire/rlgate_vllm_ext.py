"""vLLM worker extension: receive a version's full weights from the trainer over gloo.

Started with `--worker-extension-cls rlgate_vllm_ext.WeightReceiver` (this
directory on the server's PYTHONPATH: `inference.vllm_http.server_env`),
vLLM mixes `WeightReceiver` into each of its workers; the gateway calls its
methods through vLLM's `/collective_rpc` (`VLLM_SERVER_DEV_MODE=1`), which
runs them on every worker and answers with their results.

This is the CPU path: vLLM's own weight-transfer engines (`nccl`, `ipc`,
`/init_weight_transfer_engine` ...) need CUDA. The ordering is the caller's
(`inference.http_backend.HttpBackend`): the server is paused and drained
before `rlgate_receive_weights`, and resumed after it.
"""

from __future__ import annotations

import itertools
import json
import logging
import time

try:  # the server's interpreter: this directory is on its PYTHONPATH
    from rlgate_weight_wire import Rendezvous, receive_weights
except ImportError:  # rlgate's own interpreter (tests, linters)
    from inference.weight_wire.rlgate_weight_wire import Rendezvous, receive_weights

logger = logging.getLogger(__name__)


class WeightReceiver:
    """Methods mixed into a vLLM worker (`self` is the worker: `rank`, `reload_weights`)."""

    def rlgate_worker_rank(self) -> int:
        """This worker's rank in the server (one result per worker: their count)."""
        return int(self.rank)

    def rlgate_receive_weights(
        self, rendezvous: str, rank_offset: str = "1", timeout_s: str = "600"
    ) -> dict:
        """Join the transfer as rank `rank_offset` + this worker's rank, then reload the model
        in place. (`rank_offset` > 1: several servers in one transfer, each its own offset.)

        Arguments are strings (vLLM's `/collective_rpc` passes serialised values only).
        Nothing is loaded unless every byte arrived (`receive_weights`).
        """
        rdv = Rendezvous.from_json(json.loads(rendezvous))
        rank = int(rank_offset) + int(self.rank)
        t0 = time.perf_counter()
        # the last transfer's buffers: its tensors were copied into the model by its reload
        spare = self.__dict__.setdefault("_rlgate_buffers", [])
        weights = list(receive_weights(rdv, rank, float(timeout_s), spare))
        t1 = time.perf_counter()
        self.reload_weights(weights_iterator=iter(weights))  # vLLM's in-place reload
        if self._rlgate_aliased(spare):  # the model kept a view: never overwrite those bytes
            spare.clear()
        t2 = time.perf_counter()
        nbytes = sum(t.numel() * t.element_size() for _, t in weights)
        logger.info(
            "v%d: %d tensors (%d bytes) received in %.2fs, loaded in %.2fs",
            rdv.version, len(weights), nbytes, t1 - t0, t2 - t1,
        )  # fmt: skip
        return {
            "version": rdv.version,
            "tensors": len(weights),
            "bytes": nbytes,
            "receive_s": t1 - t0,
            "load_s": t2 - t1,
        }

    def _rlgate_aliased(self, bufs: list) -> bool:
        """Whether any weight of the model lives in `bufs` (vLLM's loaders copy, but the
        reuse of the buffers is only safe if that stays true)."""
        ranges = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in bufs]
        model = self.model_runner.get_model()
        for t in itertools.chain(model.parameters(), model.buffers()):
            ptr = t.untyped_storage().data_ptr()
            if any(lo <= ptr < hi for lo, hi in ranges):
                return True
        return False
