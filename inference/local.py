"""In-process transformers backend: one model thread decodes every request continuously.

One worker thread owns the model and decodes every request in flight as one
batch (`inference.decode_batch`): a request joins at the next decode step,
prefilled on its own (reusing the KV of any earlier prompt it shares a
prefix with, `inference.prefix_cache`), and leaves with its cache row the
step it stops, hits its length or is cancelled. No step is spent on a
finished or padded row, and a call that arrives while others decode waits
one step, not for a batch to end. When the thread is idle, the first request
waits `batch_wait_s` for others so that a burst starts as one step. Sampling
runs for every row at once (`inference.sampling.sample_batch`), each row with
its own parameters and seeded generator, so a row's tokens do not depend on
its batch-mates.

Memory: at most `max_batch_size` rows decode together, and the batch's KV
cache (rows times its widest row's prompt and `max_tokens`, an upper bound) stays
under `kv_cache_bytes`: a request that would exceed it waits for rows to
leave; one that alone exceeds it is refused with `BackendOverloaded` (a 429).
The prefix cache holds at most `prefix_cache_bytes` (least recently used out).

Hot swap, the ordering contract (`inference.types.SwapPolicy`), for the base
weights (`load_weights`) and for one LoRA adapter (`load_adapter`) alike:

* `keep` (the default): the checkpoint or adapter is read and checked off the
  model thread; the worker then applies it between two decode steps (after
  one step's tokens are sampled, before the next forward), or at once when
  idle. Each row still generating that the swap concerns (every row for new
  base weights, that adapter's rows for an adapter) goes on with it and
  records a mark (its output length, the new version):
  `GenerateResult.version_starts`, built by `inference.types.result_with_marks`.
  Rows on an adapter keep their adapter's version across a base swap. New
  requests wait only for the in-place copy. With `clear_kv` the KV cache of
  the concerned rows is recomputed by the new weights before the next step
  (one prefill of prompt + output so far), so every later token is computed
  entirely by them; without it they decode over the cache the old weights
  computed. Rows the swap does not concern keep their cache: another
  adapter's rows decode bit for bit as without the swap.
* `drain`: `load_weights` waits in line: requests that came before it finish
  on the old weights, no request that came after it joins until then; the
  state dict is then copied in place and later requests report the new
  version. An adapter is put in the bank at once: a row takes its adapter
  when it joins, so rows decoding finish on the old adapter without anyone
  waiting for them. A completion never mixes versions.

A checkpoint that cannot be read or does not fit the model fails its
`load_weights` before anything is copied: the old weights keep serving and no
row is marked. Cost of `keep`: the running rows pause for the in-place copy
and, with `clear_kv`, one prefill of the concerned rows; a checkpoint is held
in memory next to the model until it is copied. A swap of the base weights
empties the prefix cache; an adapter swap drops that adapter's entries.

LoRA adapters (`AdapterBackend`): many adapters on the one base model, each
request naming its own (`GenerateRequest.adapter`); a step mixes them row by
row (`inference.lora.AdapterBank`). A row reports its adapter's version (the
base model's `version` when it names none); a request naming an adapter that
is not loaded fails alone.

Why not transformers' own continuous batching (`generate_batch`, its paged
cache): its manager owns the decode loop, so there is no point between two
steps to apply a keep swap, mark rows or recompute their cache, and no
per-row adapter routing; this loop is small and keeps those.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from inference.backend import BackendError, BackendOverloaded, VersionMoved
from inference.decode_batch import DecodeBatch, Job, Row, growing
from inference.lora import Adapter, AdapterBank, AdapterError, read_adapter
from inference.models import own_memory
from inference.prefix_cache import PrefixCache, PrefixKey
from inference.sampling import sample_batch
from inference.stop_strings import TextStop
from inference.swap import WeightsSource, weights_dir
from inference.types import KEEP, GenerateRequest, GenerateResult, SamplingParams, SwapPolicy

logger = logging.getLogger(__name__)


class LocalStream:
    """A generation whose tokens arrive as they are sampled (see `Backend.start_stream`)."""

    def __init__(self, backend: LocalBackend, request: GenerateRequest) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[int, float] | None] = asyncio.Queue()
        self._job = Job(request, Future(), on_token=self._push)
        backend._submit(self._job)
        self._job.future.add_done_callback(lambda _: self._push_threadsafe(None))

    def _push(self, token: int, logprob: float) -> None:
        self._push_threadsafe((token, logprob))

    def _push_threadsafe(self, item: tuple[int, float] | None) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def tokens(self) -> AsyncIterator[tuple[int, float]]:
        """(token id, logprob) pairs until generation ends; a failure raises its error here,
        as it does from `result()` (before the first token: a backend error the caller can
        still answer with its HTTP status)."""
        while (item := await self._queue.get()) is not None:
            yield item
        future = self._job.future
        if not future.cancelled() and (exc := future.exception()) is not None:
            raise exc

    def cancel(self) -> None:
        """Stop sampling this request at its next step; its result ends "cancelled"."""
        self._job.cancelled.set()

    async def result(self) -> GenerateResult:
        return await asyncio.wrap_future(self._job.future)


@dataclass
class _Swap:
    """New base weights under `drain`: applied between two batches."""

    checkpoint_dir: Path
    version: int
    future: Future


@dataclass
class _AddHooks:
    """Hook these modules (an adapter's first load), between batches."""

    modules: list[str]
    future: Future


@dataclass
class _KeepWeights:
    """New base weights under `keep`, read and checked already: applied between two steps."""

    state: dict[str, torch.Tensor]
    version: int
    clear_kv: bool
    future: Future


@dataclass
class _KeepAdapter:
    """A new version of adapter `name` under `keep`: put in the bank between two steps."""

    name: str
    adapter: Adapter
    clear_kv: bool
    future: Future

    @property
    def version(self) -> int:
        return self.adapter.version


class _Wake:
    """Queued after a keep swap so that an idle worker applies it at once."""


_WAKE = _Wake()


def _check_compatible(current: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
    """Refuse a checkpoint before copying anything, so a failed swap leaves no mixed weights."""
    missing = sorted(current.keys() - new.keys())
    unexpected = sorted(new.keys() - current.keys())
    if missing or unexpected:
        raise BackendError(f"checkpoint keys differ: missing {missing[:3]}, extra {unexpected[:3]}")
    for name, tensor in current.items():
        if new[name].shape != tensor.shape:
            raise BackendError(f"{name}: shape {tuple(new[name].shape)} != {tuple(tensor.shape)}")


def _read_checkpoint(
    checkpoint_dir: Path, model: torch.nn.Module, device: torch.device
) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, checked to fit `model` (BackendError if it does not)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for shard in sorted(checkpoint_dir.glob("*.safetensors")):
        state.update(load_file(shard, device=str(device)))
    if not state:
        raise BackendError(f"no safetensors in {checkpoint_dir}")
    _check_compatible(model.state_dict(), state)
    return state


class LocalBackend:
    """Serves a Hugging Face causal LM from `model_dir` on the CPU (or a given device)."""

    def __init__(
        self,
        model_dir: Path,
        version: int = 0,
        max_batch_size: int = 64,
        batch_wait_s: float = 0.05,
        device: str = "cpu",
        decode: Callable[[list[int]], str] | None = None,
        max_pending: int = 512,
        threads: int = 0,
        kv_cache_bytes: int = 4 << 30,
        prefix_cache_bytes: int = 512 << 20,
    ) -> None:
        """`threads`: torch intra-op threads of the thread that runs the model; 0: torch's.
        `kv_cache_bytes`: the decoding rows' KV cache at most; `prefix_cache_bytes`: the
        stored prompt prefixes' at most (the module's "Memory")."""
        from transformers import AutoModelForCausalLM

        self.model_dir = Path(model_dir)
        self.decode = decode  # needed for stop strings only
        self.max_pending = max_pending
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        self.model.to(self.device).eval()  # type: ignore[arg-type]  # transformers' stub
        if self.device.type == "cpu":  # hot swaps write every weight (`own_memory`)
            own_memory(self.model)
        self.pad_id = self.model.config.pad_token_id or 0
        self._version = version
        self._adapters = AdapterBank(self.model)
        self.kv_cache_bytes = kv_cache_bytes
        self.prefixes = PrefixCache(prefix_cache_bytes)  # the model thread's only
        self._kv_token_bytes = _kv_bytes_per_token(self.model.config)
        self.threads = threads
        self.torch_threads: int | None = None  # what the model thread runs on, once started
        self._queue: queue.Queue[Job | _Swap | _AddHooks | _Wake | None] = queue.Queue()
        # keep swaps waiting for the worker's next step (or its next idle moment)
        self._keep: collections.deque[_KeepWeights | _KeepAdapter] = collections.deque()
        self._keep_lock = threading.Lock()
        self._waiting, self._waiting_lock = 0, threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="local-backend", daemon=True)
        self._closed = False
        self._thread.start()

    @property
    def version(self) -> int:
        return self._version

    @property
    def max_context(self) -> int:
        return int(self.model.config.max_position_embeddings)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if not request.prompt_token_ids:
            raise BackendError("empty prompt")
        return await asyncio.wrap_future(self._submit(Job(request, Future())))

    def start_stream(self, request: GenerateRequest) -> LocalStream:
        if not request.prompt_token_ids:
            raise BackendError("empty prompt")
        return LocalStream(self, request)

    async def load_weights(
        self, checkpoint_dir: WeightsSource, version: int, policy: SwapPolicy = KEEP
    ) -> None:
        """`keep`: read off the model thread, copied in between two decode steps; `drain`:
        read and copied between two batches (the module's ordering contract)."""
        source = weights_dir(checkpoint_dir)
        if policy.mode == "drain":
            await asyncio.wrap_future(self._submit(_Swap(source, version, Future())))
            return
        try:
            state = await asyncio.to_thread(_read_checkpoint, source, self.model, self.device)
        except Exception as exc:
            logger.exception("weight load failed")
            raise BackendError(f"weight load failed: {exc}") from exc
        keep = _KeepWeights(state, version, policy.clear_kv, Future())
        await asyncio.wrap_future(self._defer_to_next_step(keep))

    def adapter_version(self, name: str) -> int | None:
        return self._adapters.version(name)

    async def load_adapter(
        self, name: str, adapter_dir: Path, version: int, policy: SwapPolicy = KEEP
    ) -> None:
        """Read the adapter off the model thread; `keep`: the worker puts it in the bank and
        moves that adapter's rows onto it between two steps; `drain`: put in the bank now,
        the running batch keeps its snapshot."""
        try:
            adapter = await asyncio.to_thread(
                read_adapter, Path(adapter_dir), self._adapters.linears, version, self.device
            )
        except (AdapterError, OSError) as exc:
            raise BackendError(f"adapter {name!r} not loaded: {exc}") from exc
        if policy.mode == "keep":
            keep = _KeepAdapter(name, adapter, policy.clear_kv, Future())
            await asyncio.wrap_future(self._defer_to_next_step(keep))
        else:
            unhooked = self._adapters.unhooked(adapter)
            if unhooked:
                await asyncio.wrap_future(self._submit(_AddHooks(unhooked, Future())))
            self._adapters.put(name, adapter)
        logger.info(
            "adapter %s now serves version %d (%.1f MB)", name, version, adapter.nbytes / 1e6
        )

    async def unload_adapter(self, name: str) -> None:
        if self._closed:
            raise BackendError("local backend is closed")
        self._adapters.pop(name)
        logger.info("adapter %s unloaded", name)

    async def health(self) -> bool:
        return self._thread.is_alive() and not self._closed

    async def close(self) -> None:
        if not self._closed:
            with self._keep_lock:
                self._closed = True
            self._queue.put(None)
            await asyncio.to_thread(self._thread.join, 30)
            self._fail_keep_swaps()

    def _submit(self, item: Job | _Swap | _AddHooks) -> Future:
        if self._closed:
            raise BackendError("local backend is closed")
        if isinstance(item, Job):
            if item.need * self._kv_token_bytes > self.kv_cache_bytes:
                raise BackendOverloaded(
                    f"a prompt of {len(item.request.prompt_token_ids)} tokens and max_tokens "
                    f"{item.request.params.max_tokens} need more KV cache than this backend "
                    f"holds ({self.kv_cache_bytes >> 20} MiB)"
                )
            with self._waiting_lock:  # queued or in line, not yet decoding
                if self._waiting >= self.max_pending:
                    raise BackendOverloaded(f"{self.max_pending} requests are already waiting")
                self._waiting += 1
        self._queue.put(item)
        return item.future

    def _defer_to_next_step(self, swap: _KeepWeights | _KeepAdapter) -> Future:
        """Hand a keep swap to the worker: applied after the running step, or at once if idle."""
        with self._keep_lock:
            if self._closed:
                raise BackendError("local backend is closed")
            self._keep.append(swap)
        self._queue.put(_WAKE)
        return swap.future

    def _fail_keep_swaps(self) -> None:
        with self._keep_lock:
            left, self._keep = list(self._keep), collections.deque()
        for swap in left:
            if swap.future.set_running_or_notify_cancel():
                swap.future.set_exception(BackendError("local backend is closed"))

    # --- worker thread -------------------------------------------------------

    def _serve(self) -> None:
        # Torch's thread count is per OS thread once that thread has run an op: set it here,
        # in the one thread that runs the model, not in whichever thread built the backend.
        if self.threads > 0:
            torch.set_num_threads(self.threads)
        self.torch_threads = torch.get_num_threads()
        logger.info("local backend samples on %d torch threads", self.torch_threads)
        try:
            self._serve_queue()
        finally:
            self._fail_keep_swaps()

    def _serve_queue(self) -> None:
        """Decode until shut down. `pending` holds, in arrival order, the requests that have
        not joined yet and the drain swaps and shutdown they must not overtake."""
        pending: collections.deque[Job | _Swap | None] = collections.deque()
        batch = DecodeBatch()
        while True:
            if not batch.rows:
                while pending and not isinstance(pending[0], Job):  # nothing runs: apply it
                    barrier = pending.popleft()
                    if barrier is None:
                        return
                    assert not isinstance(barrier, Job)
                    self._swap(barrier)
                if not pending:
                    self._receive(self._queue.get(), pending)
                    if pending and isinstance(pending[-1], Job):
                        self._gather(pending)
            else:
                while True:
                    try:
                        self._receive(self._queue.get_nowait(), pending)
                    except queue.Empty:
                        break
            self._apply_keep(batch)  # keep swaps handed over meanwhile: new rows start on them
            self._admit(pending, batch)
            if batch.rows:
                self._decode_step(batch)
                self._finish(batch)
                recompute = self._apply_keep(batch)  # between two steps: where keep swaps land
                if recompute:
                    self._recompute_kv(batch, recompute)

    def _receive(
        self,
        item: Job | _Swap | _AddHooks | _Wake | None,
        pending: collections.deque[Job | _Swap | None],
    ) -> None:
        """File one item of the queue: hooks now (no forward runs), keep swaps at the next
        point between steps, the rest in line."""
        if isinstance(item, _AddHooks):
            self._swap(item)
        elif not isinstance(item, _Wake):
            pending.append(item)

    def _gather(self, pending: collections.deque[Job | _Swap | None]) -> None:
        """Idle: wait up to `batch_wait_s` for more requests, so a burst starts as one step."""
        while len(pending) < self.max_batch_size and isinstance(pending[-1], Job):
            try:
                self._receive(self._queue.get(timeout=self.batch_wait_s), pending)
            except queue.Empty:
                return

    def _admit(self, pending: collections.deque[Job | _Swap | None], batch: DecodeBatch) -> None:
        """Prefill the requests at the head of the line that fit, sample their first token
        and add them to `batch`; a request stays in line while the batch is full."""
        joining: list[Row] = []
        widest = max((r.job.need for r in batch.rows), default=0)
        while pending and isinstance(head := pending[0], Job):
            rows = len(batch.rows) + len(joining) + 1
            widest_then = max(widest, head.need)
            full = rows > self.max_batch_size or (
                rows * widest_then * self._kv_token_bytes > self.kv_cache_bytes
            )
            if full and (joining or batch.rows):  # a lone request fits (checked on submit)
                break
            pending.popleft()
            with self._waiting_lock:
                self._waiting -= 1
            if not head.future.set_running_or_notify_cancel():
                continue
            if head.cancelled.is_set():  # cancelled while in line: ends before it starts
                row = Row(head, None, self._version, None, None)
                row.finish = "cancelled"
                head.future.set_result(row.result())
                continue
            name = head.request.adapter
            adapter = None if name is None else self._adapters.snapshot({name}).get(name)
            if name is not None and adapter is None:
                head.future.set_exception(BackendError(f"adapter {name!r} is not loaded"))
                continue
            version = self._version if adapter is None else adapter.version
            if head.request.version not in (None, version):  # a swap landed since it looked
                head.future.set_exception(
                    VersionMoved(f"serving v{version}, not v{head.request.version}")
                )
                continue
            generator, stop = self._generator(head.request), self._stop_check(head.request.params)
            joining.append(Row(head, adapter, version, generator, stop))
            widest = widest_then
        if joining:
            self._prefill(joining, batch)

    @torch.no_grad()
    def _prefill(self, joining: list[Row], batch: DecodeBatch) -> None:
        """Prefill each distinct prompt of `joining` once, in one forward (each reusing its
        longest stored prefix), sample every row's first token, and add the rows that go on
        to `batch`."""
        groups: dict[tuple[Any, ...], list[Row]] = {}
        for row in joining:
            groups.setdefault((id(row.adapter), tuple(row.prompt)), []).append(row)
        heads = [rows[0] for rows in groups.values()]
        try:
            cache, mask, logits = self._prefill_prompts(heads)
        except Exception as exc:
            logger.exception("prefill failed")
            for row in joining:
                row.job.future.set_exception(BackendError(f"generation failed: {exc}"))
            return
        for i, head in enumerate(heads):
            cols = mask[i].nonzero()[:, 0]
            kv = [
                (layer.keys[i : i + 1, :, cols], layer.values[i : i + 1, :, cols])
                for layer in cache.layers
            ]
            self.prefixes.store(self._prefix_key(head), head.prompt, kv)
        of_head = [i for i, rows in enumerate(groups.values()) for _ in rows]
        rows = [row for group in groups.values() for row in group]
        self._sample(rows, logits[of_head])
        for row in rows:
            if row.finish is not None:
                row.job.future.set_result(row.result())
        going = [i for i, row in enumerate(rows) if row.finish is None]
        if going:
            index = torch.tensor([of_head[i] for i in going], device=mask.device)
            for layer in cache.layers:
                layer.keys = layer.keys.index_select(0, index)
                layer.values = layer.values.index_select(0, index)
            batch.join([rows[i] for i in going], growing(cache), mask.index_select(0, index))

    def _prefill_prompts(self, rows: list[Row]) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """One forward over the prompts of `rows`, each after its stored prefix: (the cache,
        [rows, width], its mask, 1 where a row has a position, and each row's last logits).

        Row i's positions: its reused prefix, left-padded to the longest reused prefix,
        then the rest of its prompt, left-padded to the longest rest; positions count
        from 0 at its first token, so the padding between the two parts is masked out
        and changes nothing.
        """
        found = [self.prefixes.lookup(self._prefix_key(r), r.prompt) for r in rows]
        reused = max(n for n, _ in found)
        rest = max(len(r.prompt) - n for r, (n, _) in zip(rows, found, strict=True))
        device = self.device
        ids = torch.full((len(rows), rest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), reused + rest), dtype=torch.long)
        positions = torch.zeros((len(rows), rest), dtype=torch.long)
        for i, (row, (n, _)) in enumerate(zip(rows, found, strict=True)):
            tail = row.prompt[n:]
            ids[i, rest - len(tail) :] = torch.tensor(tail, dtype=torch.long)
            positions[i, rest - len(tail) :] = torch.arange(n, len(row.prompt))
            mask[i, reused - n : reused] = 1
            mask[i, reused + rest - len(tail) :] = 1
        past = None
        if reused:
            past = DynamicCache(ddp_cache_data=_left_padded([kv for _, kv in found], reused))
        with self._adapters.routing([r.adapter for r in rows]):
            out = self.model(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                position_ids=positions.to(device),
                past_key_values=past,
                use_cache=True,
                logits_to_keep=1,
            )
        return out.past_key_values, mask.to(device), out.logits[:, -1, :]

    def _prefix_key(self, row: Row) -> PrefixKey:
        """The weights that compute `row`'s prompt now."""
        if row.adapter is None:
            return (None, None, self._version)
        return (row.job.request.adapter, row.adapter.version, self._version)

    @torch.no_grad()
    def _decode_step(self, batch: DecodeBatch) -> None:
        """One forward for every row: feed its last token, sample its next."""
        for row in batch.rows:
            if row.job.cancelled.is_set():
                row.finish = "cancelled"
        self._finish(batch)
        if not batch.rows:
            return
        device = self.device
        ids = torch.tensor([[r.out_ids[-1]] for r in batch.rows], dtype=torch.long, device=device)
        positions = torch.tensor([[r.kv_len] for r in batch.rows], dtype=torch.long, device=device)
        mask = batch.grow()
        try:
            with self._adapters.routing([r.adapter for r in batch.rows]):
                out = self.model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=positions,
                    past_key_values=batch.cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
        except Exception as exc:
            logger.exception("decode step failed")
            for row in batch.rows:
                row.job.future.set_exception(BackendError(f"generation failed: {exc}"))
            batch.leave(list(range(len(batch.rows))))
            return
        batch.cache = out.past_key_values
        self._sample(batch.rows, out.logits[:, -1, :])

    @staticmethod
    def _sample(rows: list[Row], logits: torch.Tensor) -> None:
        tokens, logprobs = sample_batch(
            logits, [r.job.request.params for r in rows], [r.generator for r in rows]
        )
        for row, token, logprob in zip(rows, tokens, logprobs, strict=True):
            row.take(token, logprob)

    @staticmethod
    def _finish(batch: DecodeBatch) -> None:
        """Answer the rows that ended and drop them from the batch."""
        done = [i for i, r in enumerate(batch.rows) if r.finish is not None]
        for i in done:
            batch.rows[i].job.future.set_result(batch.rows[i].result())
        batch.leave(done)

    def _swap(self, swap: _Swap | _AddHooks) -> None:
        if isinstance(swap, _AddHooks):
            if swap.future.set_running_or_notify_cancel():
                self._adapters.add_hooks(swap.modules)
                swap.future.set_result(None)
        elif swap.future.set_running_or_notify_cancel():
            try:
                state = _read_checkpoint(swap.checkpoint_dir, self.model, self.device)
                with torch.no_grad():
                    self.model.load_state_dict(state, strict=True)
                # Free the loaded copy before answering: freeing hundreds of MB holds the GIL
                # for tens of ms, which would otherwise stall whatever runs right after the swap.
                state.clear()
                self._version = swap.version
                self.prefixes.drop(everything=True)
                logger.info("now serving version %d from %s", swap.version, swap.checkpoint_dir)
                swap.future.set_result(None)
            except Exception as exc:  # the swap fails, the old weights keep serving
                logger.exception("weight load failed")
                swap.future.set_exception(BackendError(f"weight load failed: {exc}"))

    def _apply_keep(self, batch: DecodeBatch) -> list[int]:
        """Apply the keep swaps handed over so far (no forward runs now) and mark the rows of
        `batch` they concern; the rows whose KV cache must then be recomputed."""
        recompute: set[int] = set()
        while self._keep:  # read without the lock: the common case, once per step, is empty
            with self._keep_lock:
                if not self._keep:
                    break
                swap = self._keep.popleft()
            if not swap.future.set_running_or_notify_cancel():
                continue
            try:
                if isinstance(swap, _KeepWeights):
                    with torch.no_grad():
                        self.model.load_state_dict(swap.state, strict=True)
                    swap.state.clear()  # before answering (see `_swap`)
                    self._version = swap.version
                    self.prefixes.drop(everything=True)
                else:
                    self._adapters.add_hooks(self._adapters.unhooked(swap.adapter))
                    self._adapters.put(swap.name, swap.adapter)
                    self.prefixes.drop(swap.name)
            except Exception as exc:  # checked before it came here; the old weights serve
                logger.exception("keep swap to version %d failed", swap.version)
                swap.future.set_exception(BackendError(f"weight load failed: {exc}"))
                continue
            rows = self._swapped(batch, swap)
            if swap.clear_kv:
                recompute.update(rows)
            logger.info(
                "version %d swapped in between two steps (%d rows)", swap.version, len(rows)
            )
            swap.future.set_result(None)
        return sorted(recompute)

    @staticmethod
    def _swapped(batch: DecodeBatch, swap: _KeepWeights | _KeepAdapter) -> list[int]:
        """The rows of `batch` that `swap` concerns, moved onto it: every row for new base
        weights (marked if it samples the base), that adapter's rows for an adapter."""
        if isinstance(swap, _KeepWeights):
            rows = list(range(len(batch.rows)))
            labelled = [i for i in rows if batch.rows[i].adapter is None]
        else:
            rows = [i for i, r in enumerate(batch.rows) if r.job.request.adapter == swap.name]
            labelled = rows
            for i in rows:
                batch.rows[i].adapter = swap.adapter
        for i in labelled:
            if not batch.rows[i].mark(swap.version):
                logger.warning("swap to version %d under a row past it: unmarked", swap.version)
        return rows

    @torch.no_grad()
    def _recompute_kv(self, batch: DecodeBatch, rows: list[int]) -> None:
        """Recompute, in place, the cache of `rows` with the weights and adapters served now:
        one prefill each of its prompt and output but its last token (which the next step
        feeds); other rows' entries stay as they are."""
        for i in rows:
            row = batch.rows[i]
            fed = row.prompt + row.out_ids[:-1]
            with self._adapters.routing([row.adapter]):
                fresh = self.model(
                    input_ids=torch.tensor([fed], dtype=torch.long, device=self.device),
                    use_cache=True,
                    logits_to_keep=1,
                ).past_key_values
            batch.overwrite(i, fresh)

    def _stop_check(self, params: SamplingParams) -> TextStop | None:
        """A row's stop-string check: fed each sampled token, true once the text holds one.

        Linear in the text whatever the stop strings are (`inference.stop_strings`): this
        runs on the model thread, which every request sampled here waits on.
        """
        if not params.stop or self.decode is None:
            return None
        return TextStop(self.decode, params.stop)

    @staticmethod
    def _generator(request: GenerateRequest) -> torch.Generator | None:
        if request.params.seed is None:
            return None
        return torch.Generator().manual_seed(request.params.seed)


def _kv_bytes_per_token(config: Any) -> int:
    """Bytes of keys and values one position takes in every layer (float32)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * int(text.num_hidden_layers) * int(heads) * int(head_dim) * 4


def _left_padded(found: list[Any], width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the stored prefixes of several rows (None: no prefix) as one batch,
    each left-padded with zeros to `width` positions."""
    template = next(kv for kv in found if kv is not None)
    layers = []
    for layer, (k0, _) in enumerate(template):
        keys, values = [], []
        for kv in found:
            if kv is None:
                k = v = k0.new_zeros((1, k0.shape[1], 0, k0.shape[3]))
            else:
                k, v = kv[layer]
            pad = k0.new_zeros((1, k0.shape[1], width - k.shape[2], k0.shape[3]))
            keys.append(torch.cat([pad, k], dim=2))
            values.append(torch.cat([pad, v], dim=2))
        layers.append((torch.cat(keys), torch.cat(values)))
    return layers
