"""In-process transformers backend: one worker thread batches concurrent requests.

Ordering contract for hot swap: `load_weights` is queued behind the batch
that is generating; that batch finishes on the old weights, the new state
dict is copied in place, and every later batch reports the new version. A
completion therefore never mixes tokens from two versions, and the version it
reports is the one that produced all its tokens.

LoRA adapters (`AdapterBackend`): many adapters on the one base model, each
request naming its own (`GenerateRequest.adapter`); a batch mixes them row by
row (`inference.lora.AdapterBank`). `load_adapter` reads the adapter off the
model thread and puts it in the bank at once, without waiting for the batch
that is generating: a batch takes its adapters from one snapshot when it
starts, so that batch finishes with the old adapter and the next one serves
the new (the same contract, one adapter only, and no wait behind another
run's batch). Only an adapter's first load, which hooks its modules, is
queued to the model thread like `load_weights`. A row reports its adapter's
version (the base model's `version` when it names none); a request naming an
adapter that is not loaded fails alone.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from inference.backend import BackendError, BackendOverloaded
from inference.lora import Adapter, AdapterBank, AdapterError, read_adapter
from inference.sampling import sample_row
from inference.stop_strings import TextStop
from inference.swap import WeightsSource, weights_dir
from inference.types import FinishReason, GenerateRequest, GenerateResult, SamplingParams

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
    checkpoint_dir: Path
    version: int
    future: Future


@dataclass
class _AddHooks:
    """Hook these modules (an adapter's first load), between batches."""

    modules: list[str]
    future: Future


def _check_compatible(current: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
    """Refuse a checkpoint before copying anything, so a failed swap leaves no mixed weights."""
    missing = sorted(current.keys() - new.keys())
    unexpected = sorted(new.keys() - current.keys())
    if missing or unexpected:
        raise BackendError(f"checkpoint keys differ: missing {missing[:3]}, extra {unexpected[:3]}")
    for name, tensor in current.items():
        if new[name].shape != tensor.shape:
            raise BackendError(f"{name}: shape {tuple(new[name].shape)} != {tuple(tensor.shape)}")


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
        self._queue: queue.Queue[_Job | _Swap | _AddHooks | None] = queue.Queue()
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

    async def load_weights(self, checkpoint_dir: WeightsSource, version: int) -> None:
        """Swapped between two batches: a batch never mixes versions (`_Swap`)."""
        swap = _Swap(weights_dir(checkpoint_dir), version, Future())
        await asyncio.wrap_future(self._submit(swap))

    def adapter_version(self, name: str) -> int | None:
        return self._adapters.version(name)

    async def load_adapter(self, name: str, adapter_dir: Path, version: int) -> None:
        try:
            adapter = await asyncio.to_thread(
                read_adapter, Path(adapter_dir), self._adapters.linears, version, self.device
            )
        except (AdapterError, OSError) as exc:
            raise BackendError(f"adapter {name!r} not loaded: {exc}") from exc
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
            self._closed = True
            self._queue.put(None)
            await asyncio.to_thread(self._thread.join, 30)

    def _submit(self, item: _Job | _Swap | _AddHooks) -> Future:
        if self._closed:
            raise BackendError("local backend is closed")
        if isinstance(item, _Job) and self._queue.qsize() >= self.max_pending:
            raise BackendOverloaded(f"{self.max_pending} requests are already waiting")
        self._queue.put(item)
        return item.future

    # --- worker thread -------------------------------------------------------

    def _serve(self) -> None:
        # Torch's thread count is per OS thread once that thread has run an op: set it here,
        # in the one thread that runs the model, not in whichever thread built the backend.
        if self.threads > 0:
            torch.set_num_threads(self.threads)
        self.torch_threads = torch.get_num_threads()
        logger.info("local backend samples on %d torch threads", self.torch_threads)
        while True:
            item = self._queue.get()
            if item is None:
                return
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
                    else:  # a swap or shutdown waits for this batch to finish
                        deferred.append(nxt)
                        break
            except queue.Empty:
                pass
            self._run_batch(batch)
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
                from safetensors.torch import load_file

                state: dict[str, torch.Tensor] = {}
                for shard in sorted(swap.checkpoint_dir.glob("*.safetensors")):
                    state.update(load_file(shard, device=str(self.device)))
                if not state:
                    raise BackendError(f"no safetensors in {swap.checkpoint_dir}")
                _check_compatible(self.model.state_dict(), state)
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
        with self._adapters.routing(rows):
            return self._decode(jobs, versions)

    def _decode(self, jobs: list[_Job], versions: list[int]) -> list[GenerateResult]:
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
        out_ids: list[list[int]] = [[] for _ in requests]
        out_lps: list[list[float]] = [[] for _ in requests]
        finish: list[FinishReason | None] = [None] * len(requests)
        max_new = max(r.params.max_tokens for r in requests)
        cache = None
        step_ids, step_pos = ids, positions
        for _ in range(max_new):
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
        return [
            GenerateResult(o, lp, f or "length", v)
            for o, lp, f, v in zip(out_ids, out_lps, finish, versions, strict=True)
        ]

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
