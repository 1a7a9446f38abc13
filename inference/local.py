"""In-process transformers backend: one worker thread batches concurrent requests.

One worker thread owns the model. It takes up to `max_batch_size` queued
requests into a static batch, prefills them left-padded, and decodes them step
by step with one KV cache; a row leaves when it stops, the batch when every
row has.

Hot swap, the ordering contract (`inference.types.SwapPolicy`), for the base
weights (`load_weights`) and for one LoRA adapter (`load_adapter`) alike:

* `keep` (the default): the checkpoint or adapter is read and checked off the
  model thread; the worker then applies it between two decode steps of the
  running batch (after one step's tokens are sampled, before the next
  forward), or at once when idle. Each row still generating that the swap
  concerns (every row for new base weights, that adapter's rows for an
  adapter) goes on with it and records a mark (its output length, the new
  version): `GenerateResult.version_starts`, built by
  `inference.types.result_with_marks`. Rows on an adapter keep their
  adapter's version across a base swap. New requests wait only for the
  in-place copy, never for a batch to finish. With `clear_kv` the KV cache
  of the concerned rows is recomputed by the new weights before the next
  step (one prefill of prompt + output so far, in the batch's left-padded
  layout and positions), so every later token is computed entirely by them;
  without it they decode over the cache the old weights computed. Rows the
  swap does not concern keep their cache: another adapter's rows decode bit
  for bit as without the swap.
* `drain`: `load_weights` is queued behind the running batch, which finishes
  on the old weights; the state dict is then copied in place and every later
  batch reports the new version. An adapter is put in the bank at once: a
  batch routes the adapters of one snapshot taken when it starts, so the
  running batch finishes on the old adapter without anyone waiting for it.
  A completion never mixes versions.

A checkpoint that cannot be read or does not fit the model fails its
`load_weights` before anything is copied: the old weights keep serving and no
row is marked. Cost of `keep`: the running batch pauses for the in-place copy
and, with `clear_kv`, one prefill of the concerned rows (their prompt and
output so far); a checkpoint is held in memory next to the model until it is
copied.

LoRA adapters (`AdapterBackend`): many adapters on the one base model, each
request naming its own (`GenerateRequest.adapter`); a batch mixes them row by
row (`inference.lora.AdapterBank`). An adapter's first load under `drain`,
which hooks its modules, is queued to the model thread like `load_weights`.
A row reports its adapter's version (the base model's `version` when it
names none); a request naming an adapter that is not loaded fails alone.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from inference.backend import BackendError, BackendOverloaded
from inference.lora import Adapter, AdapterBank, AdapterError, read_adapter
from inference.sampling import sample_row
from inference.stop_strings import TextStop
from inference.swap import WeightsSource, weights_dir
from inference.types import (
    KEEP,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    SwapPolicy,
    result_with_marks,
)

logger = logging.getLogger(__name__)


@dataclass
class _Job:
    request: GenerateRequest
    future: Future
    on_token: Callable[[int, float], None] | None = None  # called from the worker thread
    cancelled: threading.Event = field(default_factory=threading.Event)


class LocalStream:
    """A generation whose tokens arrive as they are sampled (see `Backend.start_stream`)."""

    def __init__(self, backend: LocalBackend, request: GenerateRequest) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[int, float] | None] = asyncio.Queue()
        self._job = _Job(request, Future(), on_token=self._push)
        backend._submit(self._job)
        self._job.future.add_done_callback(lambda _: self._push_threadsafe(None))

    def _push(self, token: int, logprob: float) -> None:
        self._push_threadsafe((token, logprob))

    def _push_threadsafe(self, item: tuple[int, float] | None) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def tokens(self) -> AsyncIterator[tuple[int, float]]:
        """(token id, logprob) pairs until generation ends."""
        while (item := await self._queue.get()) is not None:
            yield item

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


@dataclass
class _Running:
    """The batch that is decoding, as much of it as a keep swap changes or reads."""

    jobs: list[_Job]
    rows: list[Adapter | None]  # each row's adapter (None: the base model)
    marks: list[list[tuple[int, int]]]  # each row's (token index, version) marks
    out_ids: list[list[int]]
    finish: list[FinishReason | None]

    def live(self) -> list[int]:
        """The rows still generating."""
        return [i for i, f in enumerate(self.finish) if f is None]

    def swapped(self, swap: _KeepWeights | _KeepAdapter) -> list[int]:
        """The rows still generating that `swap` concerns, moved onto it: every row for new
        base weights (marked if it samples the base), that adapter's rows for an adapter."""
        if isinstance(swap, _KeepWeights):
            rows = self.live()
            labelled = [i for i in rows if self.rows[i] is None]
        else:
            rows = [i for i in self.live() if self.jobs[i].request.adapter == swap.name]
            labelled = rows
            for i in rows:
                self.rows[i] = swap.adapter
        for i in labelled:
            self._mark(i, swap.version)
        return rows

    def _mark(self, row: int, version: int) -> None:
        """Row `row`'s next token is sampled by `version`."""
        last = self.marks[row][-1][1]
        if version > last:
            self.marks[row].append((len(self.out_ids[row]), version))
        elif version < last:
            logger.warning("swap to version %d under a row at version %d: unmarked", version, last)


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
        max_batch_size: int = 32,
        batch_wait_s: float = 0.05,
        device: str = "cpu",
        decode: Callable[[list[int]], str] | None = None,
        max_pending: int = 512,
        threads: int = 0,
    ) -> None:
        """`threads`: torch intra-op threads of the thread that runs the model; 0: torch's."""
        from transformers import AutoModelForCausalLM

        self.model_dir = Path(model_dir)
        self.decode = decode  # needed for stop strings only
        self.max_pending = max_pending
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        self.model.to(self.device).eval()  # type: ignore[arg-type]  # transformers' stub
        self.pad_id = self.model.config.pad_token_id or 0
        self._version = version
        self._adapters = AdapterBank(self.model)
        self.threads = threads
        self.torch_threads: int | None = None  # what the model thread runs on, once started
        self._queue: queue.Queue[_Job | _Swap | _AddHooks | _Wake | None] = queue.Queue()
        # keep swaps waiting for the worker's next step (or its next idle moment)
        self._keep: collections.deque[_KeepWeights | _KeepAdapter] = collections.deque()
        self._keep_lock = threading.Lock()
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
        return await asyncio.wrap_future(self._submit(_Job(request, Future())))

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

    def _submit(self, item: _Job | _Swap | _AddHooks) -> Future:
        if self._closed:
            raise BackendError("local backend is closed")
        if isinstance(item, _Job) and self._queue.qsize() >= self.max_pending:
            raise BackendOverloaded(f"{self.max_pending} requests are already waiting")
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
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, _Wake):
                self._apply_keep(None)
                continue
            if not isinstance(item, _Job):
                self._swap(item)
                continue
            batch = [item]
            deferred: list[_Swap | _AddHooks | None] = []
            try:
                while len(batch) < self.max_batch_size:
                    nxt = self._queue.get(timeout=self.batch_wait_s)
                    if isinstance(nxt, _Job):
                        batch.append(nxt)
                    elif not isinstance(nxt, _Wake):  # a drain swap or shutdown waits for it
                        deferred.append(nxt)
                        break
            except queue.Empty:
                pass
            self._apply_keep(None)  # keep swaps that came while it gathered: it starts on them
            self._run_batch(batch)
            self._apply_keep(None)
            for d in deferred:
                if d is None:
                    return
                self._swap(d)

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
                logger.info("now serving version %d from %s", swap.version, swap.checkpoint_dir)
                swap.future.set_result(None)
            except Exception as exc:  # the swap fails, the old weights keep serving
                logger.exception("weight load failed")
                swap.future.set_exception(BackendError(f"weight load failed: {exc}"))

    def _apply_keep(self, running: _Running | None) -> list[int]:
        """Apply the keep swaps handed over so far (no forward runs now) and mark the rows of
        `running` they concern; the rows whose KV cache must then be recomputed."""
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
                else:
                    self._adapters.add_hooks(self._adapters.unhooked(swap.adapter))
                    self._adapters.put(swap.name, swap.adapter)
            except Exception as exc:  # checked before it came here; the old weights serve
                logger.exception("keep swap to version %d failed", swap.version)
                swap.future.set_exception(BackendError(f"weight load failed: {exc}"))
                continue
            rows = [] if running is None else running.swapped(swap)
            if swap.clear_kv:
                recompute.update(rows)
            logger.info(
                "version %d swapped in between two steps (%d rows)", swap.version, len(rows)
            )
            swap.future.set_result(None)
        return sorted(recompute)

    def _run_batch(self, jobs: list[_Job]) -> None:
        jobs = [j for j in jobs if j.future.set_running_or_notify_cancel()]
        loaded = self._adapters.snapshot({j.request.adapter for j in jobs if j.request.adapter})
        for j in [j for j in jobs if j.request.adapter and j.request.adapter not in loaded]:
            j.future.set_exception(BackendError(f"adapter {j.request.adapter!r} is not loaded"))
            jobs.remove(j)
        if not jobs:
            return
        try:
            results = self._generate_batch(jobs, loaded)
        except Exception as exc:
            logger.exception("batch generation failed")
            for j in jobs:
                j.future.set_exception(BackendError(f"generation failed: {exc}"))
            return
        for j, r in zip(jobs, results, strict=True):
            j.future.set_result(r)

    @torch.no_grad()
    def _generate_batch(self, jobs: list[_Job], loaded: dict[str, Adapter]) -> list[GenerateResult]:
        """Left-padded batched decoding with a KV cache; each row samples with its own params
        and its own adapter (from `loaded`, the bank's snapshot for this batch)."""
        rows = [None if j.request.adapter is None else loaded[j.request.adapter] for j in jobs]
        versions = [self._version if a is None else a.version for a in rows]
        running = _Running(
            jobs, rows, [[(0, v)] for v in versions], [[] for _ in jobs], [None] * len(jobs)
        )
        return self._decode(running)

    def _decode(self, running: _Running) -> list[GenerateResult]:
        jobs, out_ids, finish = running.jobs, running.out_ids, running.finish
        requests = [j.request for j in jobs]
        width = max(len(r.prompt_token_ids) for r in requests)
        ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for row, r in enumerate(requests):
            n = len(r.prompt_token_ids)
            ids[row, width - n :] = torch.tensor(r.prompt_token_ids, dtype=torch.long)
            mask[row, width - n :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        generators = [self._generator(r) for r in requests]
        stops = [self._stop_check(r.params) for r in requests]
        out_lps: list[list[float]] = [[] for _ in requests]
        max_new = max(r.params.max_tokens for r in requests)
        cache = None
        step_ids, step_pos = ids, positions
        for _ in range(max_new):
            with self._adapters.routing(running.rows):
                out = self.model(
                    input_ids=step_ids,
                    attention_mask=mask,
                    position_ids=step_pos,
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
            cache = out.past_key_values
            logits = out.logits[:, -1, :]
            next_ids = []
            for row, r in enumerate(requests):
                if finish[row] is None and jobs[row].cancelled.is_set():
                    finish[row] = "cancelled"
                if finish[row] is not None:
                    next_ids.append(self.pad_id)
                    continue
                token, lp = sample_row(logits[row], r.params, generators[row])
                out_ids[row].append(token)
                out_lps[row].append(lp)
                on_token, stop = jobs[row].on_token, stops[row]
                if on_token is not None:
                    on_token(token, lp)
                hit = stop is not None and stop.push(token)
                if token in r.params.stop_token_ids or hit:
                    finish[row] = "stop"
                elif len(out_ids[row]) >= r.params.max_tokens:
                    finish[row] = "length"
                next_ids.append(token)
            if all(f is not None for f in finish):
                break
            step_ids = torch.tensor(next_ids, dtype=torch.long, device=self.device)[:, None]
            step_pos = step_pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            recompute = self._apply_keep(running)  # between two steps: where keep swaps land
            if recompute:
                self._recompute_kv(cache, recompute, ids, mask, running)
        return [
            result_with_marks(o, lp, f or "length", m)
            for o, lp, f, m in zip(out_ids, out_lps, finish, running.marks, strict=True)
        ]

    def _recompute_kv(
        self, cache: Any, rows: list[int], ids: torch.Tensor, mask: torch.Tensor, running: _Running
    ) -> None:
        """Recompute, in place, the entries of `rows` (all still generating) of `cache` (a
        transformers DynamicCache) with the weights and adapters served now: one prefill of
        their prompt and output but its last token (which the next step feeds), left-padded
        and positioned as the decode loop has them; other rows' entries stay as they are."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        sampled = torch.tensor(
            [running.out_ids[i][:-1] for i in rows], dtype=torch.long, device=self.device
        ).reshape(len(rows), -1)
        fed = torch.cat([ids.index_select(0, index), sampled], dim=1)
        fed_mask = mask.index_select(0, index)[:, :-1]
        with self._adapters.routing([running.rows[i] for i in rows]):
            fresh = self.model(
                input_ids=fed,
                attention_mask=fed_mask,
                position_ids=(fed_mask.cumsum(-1) - 1).clamp(min=0),
                use_cache=True,
                logits_to_keep=1,
            ).past_key_values
        for old, new in zip(cache.layers, fresh.layers, strict=True):
            old.keys.index_copy_(0, index, new.keys)
            old.values.index_copy_(0, index, new.values)

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
