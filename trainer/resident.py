"""A resident torchrun rank group: started once per (run, world size), kept across train steps.

The worker starts `torchrun -m trainer.resident_rank` and listens on a Unix
socket in the group's scratch directory; the leader rank connects back and
the two speak `trainer.resident_protocol`. Model, AdamW state and the frozen
reference stay in the ranks' memory from one `step` to the next; each step
still writes the checkpoint of version N+1 (the inference servers load it).

Failure contract: any rank that fails ends the whole group (torchrun stops
the others, `--max-restarts=0`), the worker reads the end of the stream or
sees torchrun exit, and `ResidentGroupError` carries every local rank's
stderr tail. The group is then unusable: the caller `kill`s it and the next
attempt forms a new one from the last saved state (`trainer.resident_pool`).

Lifetime: torchrun runs as a `TetheredProcess` (it and its process group
get SIGTERM, then SIGKILL, when this process dies, SIGKILL included), and
each rank has PR_SET_PDEATHSIG on torchrun (`resident_rank.die_with_launcher`),
since torchrun starts every rank in a session of its own.

Weights without the disk (`weight_sync: collective`, docs/weight-sync.md):
global rank 0 runs a weight server (its URL comes back in `Ready`); after
each step the ranks gather the full weights to it and it offers them, and
this side writes the version's offer file. A `Step` then writes the
checkpoint only when told to (`save`); a version left unsaved is written by
`SaveWeights` before the group is released (pause, stop, idle, worker
shutdown). A crash loses it: the next group starts from the newest saved
version (`trainer.weight_server.newest_saved`).
"""

from __future__ import annotations

import contextlib
import logging
import select
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from core.config import NodeSpec
from core.lifeline import TetheredProcess
from trainer import resident_protocol as proto
from trainer.batch import Sample
from trainer.lora import ADAPTER_CONFIG
from trainer.resident_rank import SOCKET_ENV
from trainer.torchrun import kill_group, rank_env, rank_tails, torchrun_command, write_samples
from trainer.weight_publish import write_offer

logger = logging.getLogger(__name__)

POLL_S = 0.2


class ResidentGroupError(RuntimeError):
    """The group failed, exited or timed out; the message holds the ranks' stderr tails."""


def start_ranks(
    node: NodeSpec, local_ranks: int, work: Path, threads_per_rank: int, env: dict[str, str]
) -> TetheredProcess:
    """torchrun for this node's share of a resident group, logging under `work`."""
    cmd = torchrun_command(
        local_ranks,
        work / "logs",
        [],
        module="trainer.resident_rank",
        rendezvous=node.torchrun_args(),
    )
    log = open(work / "torchrun.log", "ab")  # noqa: SIM115 - torchrun holds it; closed on exit
    try:
        return TetheredProcess(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=rank_env(threads_per_rank, **env),
        )
    finally:
        log.close()


def _check_checkpoint(checkpoint_dir: Path) -> None:
    """Fail here, not in every rank (where transformers would read a missing directory as a
    hub repo id)."""
    if not any((checkpoint_dir / f).is_file() for f in ("config.json", ADAPTER_CONFIG)):
        raise FileNotFoundError(
            f"{checkpoint_dir} is neither a Hugging Face directory (config.json) "
            f"nor a LoRA adapter ({ADAPTER_CONFIG})"
        )


class ResidentGroup:
    """A torchrun group holding one run's engine at `version`; see the module docstring."""

    def __init__(
        self,
        init: proto.Init,
        world_size: int,
        *,
        node: NodeSpec | None = None,
        threads_per_rank: int = 1,
        start_timeout_s: float = 1800.0,
    ) -> None:
        """Start the ranks and wait until every one has built the engine (`Ready`)."""
        _check_checkpoint(Path(init.checkpoint_dir))
        self.node = node or NodeSpec()
        local_ranks = self.node.local_ranks(world_size)  # a bad split fails before anything starts
        self.world_size = world_size
        self.work = Path(tempfile.mkdtemp(prefix="rlgate-resident-"))
        self.version = init.version
        self.run_id = init.run_id
        self.steps = 0
        self.unsaved: proto.SaveWeights | None = None  # the current version, if not on disk
        self.last_used = time.monotonic()
        self.sock: socket.socket | None = None
        path = str(self.work / "leader.sock")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(path)
            listener.listen(1)
            try:
                env = {SOCKET_ENV: path}
                self.proc = start_ranks(self.node, local_ranks, self.work, threads_per_rank, env)
            except BaseException:
                shutil.rmtree(self.work, ignore_errors=True)
                raise
            try:
                self.sock = self._accept(listener, start_timeout_s)
                proto.send(self.sock, init)
                ready = self._reply(start_timeout_s, "start")
                if not isinstance(ready, proto.Ready):
                    raise ResidentGroupError(f"start: expected ready, got {ready!r}")
            except BaseException:
                self.kill()
                raise
        self.pids: list[int] = ready.pids
        self.weight_url = ready.weight_url
        self.optimizer_resumed = ready.optimizer_resumed
        if init.optimizer_in is not None and not ready.optimizer_resumed:
            logger.warning(
                "group at v%d started AdamW fresh: no usable state in %s",
                self.version,
                init.optimizer_in,
            )
        logger.info(
            "resident group of %d ranks (pids %s) at v%d in %s",
            world_size,
            self.pids,
            self.version,
            self.work,
        )

    def alive(self) -> bool:
        return self.sock is not None and self.proc.poll() is None

    def step(
        self,
        samples: list[Sample],
        out_dir: Path,
        tokenizer_dir: Path,
        timeout_s: float = 3600.0,
        optimizer_out: Path | None = None,
        save: bool = True,
    ) -> dict[str, Any]:
        """One step from `version` to `version + 1`, its checkpoint in `out_dir` if `save`
        (and AdamW's state in `optimizer_out`, if given); offered if the group offers."""
        path = write_samples(samples, self.work / "samples.pt")
        out_dir = Path(out_dir).resolve()
        msg = proto.Step(
            str(path),
            str(out_dir),
            str(tokenizer_dir),
            self.version,
            optimizer_out=str(optimizer_out) if optimizer_out is not None else None,
            save=save,
        )
        done = self._call(msg, timeout_s, f"step from v{self.version}")
        self.version = int(done.metrics["version"])
        self.steps += 1
        self.unsaved = None if save else proto.SaveWeights(str(out_dir), str(tokenizer_dir))
        if self.weight_url is not None:
            write_offer(out_dir, f"{self.weight_url}/runs/{self.run_id}", self.version)
        return {**done.metrics, "saved": float(save)}

    def save_weights(self, timeout_s: float = 600.0) -> None:
        """Write the current version's checkpoint if a step left it unsaved."""
        if self.unsaved is not None:
            self._call(self.unsaved, timeout_s, f"save of v{self.version}")
            self.unsaved = None

    def save_optimizer(self, state_dir: Path, timeout_s: float = 600.0) -> None:
        """AdamW's sharded state for the current version, into `state_dir` (DCP)."""
        self._call(proto.SaveOptimizer(str(state_dir)), timeout_s, "optimizer save")

    def release(self, optimizer_dir: Path | None = None, timeout_s: float = 600.0) -> None:
        """Write an unsaved version, save AdamW (when `optimizer_dir` is given) and stop the
        ranks; kill them on failure."""
        try:
            if self.alive():
                self.save_weights(timeout_s)
                if optimizer_dir is not None:
                    self.save_optimizer(optimizer_dir, timeout_s)
                self._call(proto.Shutdown(), timeout_s, "shutdown")
                self.proc.wait(timeout=timeout_s)
        except (ResidentGroupError, subprocess.TimeoutExpired, OSError):
            logger.exception("resident group in %s did not stop cleanly: killing it", self.work)
        finally:
            self.kill()

    def kill(self) -> None:
        """Stop torchrun and every rank now, and drop the scratch directory. Idempotent."""
        if self.sock is not None:
            self.sock.close()  # the leader sees the end of the stream and exits
            self.sock = None
        if self.proc.poll() is None:
            kill_group(self.proc)  # torchrun's SIGTERM handler stops its ranks
        self.proc.wait()
        shutil.rmtree(self.work, ignore_errors=True)

    # --- the conversation with the leader

    def _connected(self, what: str) -> socket.socket:
        if self.sock is None:
            raise self._failed(what, "the group has stopped")
        return self.sock

    def _call(self, msg: proto.Message, timeout_s: float, what: str) -> proto.Done:
        if not self.alive():
            raise self._failed(what, "the group has stopped")
        self.last_used = time.monotonic()
        try:
            proto.send(self._connected(what), msg)
        except OSError as exc:
            raise self._failed(what, exc) from exc
        reply = self._reply(timeout_s, what)
        self.last_used = time.monotonic()
        if not isinstance(reply, proto.Done):
            raise self._failed(what, f"unexpected reply {reply!r}")
        return reply

    def _reply(self, timeout_s: float, what: str) -> proto.Message:
        """The leader's next message, while torchrun lives and within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        sock = self._connected(what)
        while True:
            ready, _, _ = select.select([sock], [], [], POLL_S)
            if ready:
                try:
                    return proto.recv(sock)
                except (proto.ProtocolError, OSError) as exc:
                    raise self._failed(what, exc) from exc
            if self.proc.poll() is not None:
                raise self._failed(what, f"torchrun exited {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise self._failed(what, f"no answer in {timeout_s:.0f} s")

    def _accept(self, listener: socket.socket, timeout_s: float) -> socket.socket:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([listener], [], [], POLL_S)
            if ready:
                return listener.accept()[0]
            if self.proc.poll() is not None:
                raise self._failed("start", f"torchrun exited {self.proc.returncode}")
        raise self._failed("start", f"no leader rank in {timeout_s:.0f} s")

    def _failed(self, what: str, why: object) -> ResidentGroupError:
        # give torchrun a moment to stop the ranks and flush their logs: the traceback is there
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        tails = rank_tails(self.work)
        return ResidentGroupError(f"resident group {what} failed ({why})\n{tails}")
