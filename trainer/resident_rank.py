"""torchrun entry of a resident rank: build the engine once, then run commands until told to stop.

    python -m torch.distributed.run ... -m trainer.resident_rank

Started by `trainer.resident.ResidentGroup` (and, on the other nodes of a
multi-node group, by `trainer.resident_join`). What a rank does:

1. The leader (local rank 0 on the node whose worker set `SOCKET_ENV`)
   connects to the worker, reads `Init` and publishes it, with its global
   rank, in torchrun's store; every other rank reads it from there.
2. Every rank builds the run's engine (`trainer.engines`) from version N's
   checkpoint, loads AdamW's saved state if `Init` names one, and joins a
   gloo group of its own for commands (long timeout: a group may sit idle
   for as long as `RLGATE_RESIDENT_IDLE_S`).
3. Loop: the leader reads a command from the worker and broadcasts it (with
   the samples of a `Step`); every rank runs it; the leader replies `Done`.

Any exception ends the rank with a traceback on its stderr: torchrun then
stops the other ranks and the worker sees the stream end. The rank also dies
with torchrun (PR_SET_PDEATHSIG), so a SIGKILLed launcher leaves no rank.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from trainer import resident_protocol as proto
from trainer.batch import Sample
from trainer.config import ParallelConfig, RunConfig
from trainer.engine import Engine
from trainer.engines import engine_class, torchrun_engine
from trainer.torchrun import read_samples
from trainer.weight_server import WeightServer, distributed_hf_state

SOCKET_ENV = "RLGATE_RESIDENT_SOCKET"  # set by the worker that owns the queue, on its node only
WEIGHT_SECRET_ENV = "RLGATE_WEIGHT_SYNC_SECRET"  # the worker's, inherited: weight_sync_secret
INIT_KEY = "rlgate/resident/init"
COMMAND_TIMEOUT = timedelta(days=7)  # an idle group waits on the next command this long
PR_SET_PDEATHSIG = 1

logger = logging.getLogger(__name__)


def die_with_launcher() -> None:
    """SIGKILL this rank when its parent (torchrun) dies, however it dies (Linux)."""
    if sys.platform != "linux":
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # torchrun died before the prctl took effect
        os._exit(1)


def launcher_store(timeout: timedelta) -> dist.TCPStore:
    """A client of the store torchrun's agent hosts (MASTER_ADDR/PORT): shared by all nodes."""
    return dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )


def connect_worker(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    return sock


def build_engine(init: proto.Init) -> Engine:
    """The run's engine at version N on this rank (collective: every rank calls it)."""
    cfg = RunConfig.model_validate(init.config["run"])
    parallel = ParallelConfig.model_validate(init.config.get("parallel") or {})
    ref = Path(init.reference_dir) if init.reference_dir else None
    engine = engine_class(torchrun_engine(cfg.engine))(
        Path(init.checkpoint_dir), init.version, cfg, parallel, reference_dir=ref
    )
    if init.optimizer_in is not None:
        engine.load_optimizer(Path(init.optimizer_in))
    return engine


class Rank:
    """One rank's command loop; the leader also holds the worker's socket.

    weight_sync collective: global rank 0 runs a `WeightServer`; after each
    step every rank takes part in gathering the full weights to it, and it
    offers them under the run's id (`trainer.weight_server`).
    """

    def __init__(
        self,
        engine: Engine,
        leader_rank: int,
        sock: socket.socket | None,
        run_id: str = "",
        weight_host: str = "127.0.0.1",
        weight_secret: str = "",
    ) -> None:
        self.engine, self.leader_rank, self.sock = engine, leader_rank, sock
        self.run_id = run_id
        self.commands = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
        self.steps = 0  # steps this group has run: 1, 2, 3 ... while the model stays resident
        collective = engine.cfg.weight_sync == "collective"
        self.weights = (
            WeightServer(weight_host, secret=weight_secret)
            if collective and dist.get_rank() == 0
            else None
        )

    def next_command(self) -> tuple[proto.Message, list[Sample] | None]:
        """The leader's next command (and a Step's samples), the same on every rank."""
        payload: list[tuple[proto.Message, list[Sample] | None] | None] = [None]
        if self.sock is not None:
            msg = proto.recv(self.sock)
            samples = read_samples(Path(msg.samples)) if isinstance(msg, proto.Step) else None
            payload = [(msg, samples)]
        dist.broadcast_object_list(payload, src=self.leader_rank, group=self.commands)
        command = payload[0]
        if command is None:
            raise proto.ProtocolError("the leader broadcast no command")
        return command

    def reply(self, msg: proto.Message) -> None:
        if self.sock is not None:
            proto.send(self.sock, msg)

    def serve(self) -> None:
        found: list = [None] * dist.get_world_size()
        url = self.weights.url if self.weights is not None else None
        dist.all_gather_object(found, (os.getpid(), url), group=self.commands)
        pids = [pid for pid, _ in found]
        engine = self.engine
        ready = proto.Ready(pids, engine.version, bool(engine.optimizer_resumed), found[0][1])
        self.reply(ready)
        while True:
            msg, samples = self.next_command()
            if isinstance(msg, proto.Step):
                if msg.version != engine.version:
                    raise RuntimeError(f"step from v{msg.version} sent at v{engine.version}")
                metrics = engine.step(samples or [])  # a Step always carries its samples
                if msg.optimizer_out is not None:
                    engine.save_optimizer(Path(msg.optimizer_out))
                if msg.save:
                    engine.save(Path(msg.out_dir), Path(msg.tokenizer_dir))
                if engine.cfg.weight_sync == "collective":
                    state = distributed_hf_state(engine)  # collective; None off rank 0
                    if self.weights is not None and state is not None:
                        self.weights.publish(self.run_id, engine.version, state)
                self.steps += 1
                engine.optimizer_resumed = True  # the next step starts from these moments
                done = {**metrics, "version": engine.version, "group_steps": self.steps}
                self.reply(proto.Done(done))
            elif isinstance(msg, proto.SaveWeights):
                engine.save(Path(msg.out_dir), Path(msg.tokenizer_dir))
                self.reply(proto.Done({"version": engine.version}))
            elif isinstance(msg, proto.SaveOptimizer):
                engine.save_optimizer(Path(msg.state_dir))
                self.reply(proto.Done({"version": engine.version}))
            elif isinstance(msg, proto.Shutdown):
                engine.close()
                self.reply(proto.Done())
                return
            else:
                raise proto.ProtocolError(f"unexpected command {msg!r}")


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    die_with_launcher()
    path = os.environ.get(SOCKET_ENV)
    leader = bool(path) and os.environ.get("LOCAL_RANK") == "0"
    store = launcher_store(COMMAND_TIMEOUT)
    sock = None
    if leader and path:
        sock = connect_worker(path)
        init = proto.recv(sock)
        if not isinstance(init, proto.Init):
            raise proto.ProtocolError(f"expected init, got {init!r}")
        published = {"leader": int(os.environ["RANK"]), "init": proto.encode(init).decode()}
        store.set(INIT_KEY, json.dumps(published))
    published = json.loads(store.get(INIT_KEY))
    init = proto.decode(published["init"])
    if not isinstance(init, proto.Init):
        raise proto.ProtocolError(f"expected init, got {init!r}")
    engine = build_engine(init)
    try:
        # The secret comes from the worker's environment (torchrun passes it on), never
        # through `Init`, which is published in torchrun's store for every rank to read.
        secret = os.environ.get(WEIGHT_SECRET_ENV, "")
        Rank(engine, published["leader"], sock, init.run_id, init.weight_host, secret).serve()
    finally:
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
