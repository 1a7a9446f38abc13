"""`Backend` over an SGLang server's native HTTP API: token ids in, ids and logprobs out.

Fields of SGLang's documented API this relies on (docs: "Sampling
Parameters", "Native APIs", "SGLang for RL Systems"; `io_struct.py`):

* ``POST /generate`` with ``input_ids``, ``sampling_params``
  (``max_new_tokens``, ``temperature``, ``top_p``, ``stop_token_ids``,
  ``stop``, ``sampling_seed``), ``return_logprob: true``,
  ``logprob_start_len: -1`` (logprobs of output tokens only), ``stream``.
  The answer's ``meta_info`` has ``output_token_logprobs`` as
  ``[logprob, token_id, text]`` triples, ``completion_tokens`` and
  ``finish_reason`` as ``{"type": "stop"|"length"|"abort", ...}``. A stream
  is server-sent events of such answers, each holding everything generated
  so far (or only the new part with ``--incremental-streaming-output``; both
  are read correctly, by counting ``completion_tokens``), then ``[DONE]``.
* ``POST /pause_generation``, ``POST /update_weights_from_disk``
  (``model_path``, ``weight_version``; answers ``success``, ``message``),
  ``POST /continue_generation``: the documented order for a weight update.
* ``GET /health``.

Hot-swap ordering contract (same as the vLLM backend's): `load_weights`
stops admitting new requests, waits for the in-flight ones to finish (up
to `drain_timeout_s`), pauses generation, loads, continues, and admits
again. Every result therefore records the single version that sampled all
its tokens. A request still running when the drain times out is aborted
by the pause and fails with `BackendError` (with several replicas the
`ReplicaSet` has already drained it, so this only happens to stragglers).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from inference.backend import BackendError
from inference.http_common import (
    HttpBackendConfig,
    check_response,
    check_status,
    iter_sse,
    json_body,
    make_client,
    transport_errors,
)
from inference.types import FinishReason, GenerateRequest, GenerateResult

logger = logging.getLogger(__name__)


def generate_payload(request: GenerateRequest, stream: bool) -> dict[str, Any]:
    """The `/generate` body for one rlgate request."""
    p = request.params
    sampling: dict[str, Any] = {
        "max_new_tokens": p.max_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
    }
    if p.stop_token_ids:
        sampling["stop_token_ids"] = list(p.stop_token_ids)
    if p.stop:
        sampling["stop"] = list(p.stop)
    if p.seed is not None:
        sampling["sampling_seed"] = p.seed
    return {
        "input_ids": list(request.prompt_token_ids),
        "sampling_params": sampling,
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": stream,
    }


def token_logprobs(meta: dict[str, Any]) -> list[tuple[int, float]]:
    """(token id, logprob) pairs from `meta_info.output_token_logprobs`."""
    try:
        return [(int(t), float(lp)) for lp, t, *_ in meta.get("output_token_logprobs") or []]
    except (TypeError, ValueError) as exc:
        raise BackendError(f"malformed output_token_logprobs: {exc}") from exc


def finish_of(meta: dict[str, Any]) -> FinishReason | None:
    """rlgate's finish reason from SGLang's; an aborted request is an error."""
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind is None:
        return None
    if kind == "abort":
        msg = reason.get("message") if isinstance(reason, dict) else ""
        raise BackendError(f"SGLang aborted the request: {msg or 'no reason given'}")
    return "length" if kind == "length" else "stop"


class SGLangStream:
    """One streaming `/generate` call, read in a task as soon as it starts."""

    def __init__(self, backend: SGLangBackend, request: GenerateRequest) -> None:
        self._backend = backend
        self._request = request
        self._queue: asyncio.Queue[tuple[int, float] | None] = asyncio.Queue()
        self._ids: list[int] = []
        self._lps: list[float] = []
        self._cancelled = False
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> GenerateResult:
        try:
            async with self._backend.admitted() as version:
                finish = await self._read()
                return GenerateResult(self._ids, self._lps, finish, version)
        except asyncio.CancelledError:
            if not self._cancelled:
                raise
            # closing the connection makes SGLang abort the request on its side
            return GenerateResult(self._ids, self._lps, "cancelled", self._backend.version)
        finally:
            self._queue.put_nowait(None)

    async def _read(self) -> FinishReason:
        body = generate_payload(self._request, stream=True)
        finish: FinishReason | None = None
        with transport_errors("SGLang /generate stream"):
            async with self._backend.client.stream("POST", "/generate", json=body) as resp:
                await check_response(resp, "SGLang /generate")
                async for event in iter_sse(resp):
                    meta = event.get("meta_info") or {}
                    pairs = token_logprobs(meta)
                    total = int(meta.get("completion_tokens", len(self._ids) + len(pairs)))
                    new = total - len(self._ids)
                    if new > len(pairs) or new < 0:
                        raise BackendError("stream lost tokens: completion_tokens out of step")
                    for tok, lp in pairs[len(pairs) - new :] if new else []:
                        self._ids.append(tok)
                        self._lps.append(lp)
                        self._queue.put_nowait((tok, lp))
                    finish = finish_of(meta) or finish
        if finish is None:
            raise BackendError("SGLang stream ended without a finish_reason")
        return finish

    async def tokens(self) -> AsyncIterator[tuple[int, float]]:
        while (item := await self._queue.get()) is not None:
            yield item
        await self.result()  # raises the stream's BackendError, if it failed

    def cancel(self) -> None:
        if not self._task.done():
            self._cancelled = True
            self._task.cancel()
            self._queue.put_nowait(None)  # the task may be cancelled before it ever ran

    async def result(self) -> GenerateResult:
        try:
            return await asyncio.shield(self._task)
        except asyncio.CancelledError:
            if not (self._cancelled and self._task.cancelled()):
                raise  # our caller is being cancelled, not the stream
            return GenerateResult(self._ids, self._lps, "cancelled", self._backend.version)


class SGLangBackend:
    """Drives one SGLang server (see the module docstring for the API subset and swap order)."""

    def __init__(
        self,
        config: HttpBackendConfig,
        version: int = 0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.config = config
        self._version = version
        self.client = client or make_client(config)
        self._admitting = asyncio.Event()
        self._admitting.set()
        self._in_flight = 0
        self._swap_lock = asyncio.Lock()

    @property
    def version(self) -> int:
        return self._version

    @contextlib.asynccontextmanager
    async def admitted(self) -> AsyncIterator[int]:
        """Hold one in-flight slot; waits while a swap is in progress. Yields the version."""
        await self._admitting.wait()
        self._in_flight += 1
        try:
            yield self._version
        finally:
            self._in_flight -= 1

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if not request.prompt_token_ids:
            raise BackendError("empty prompt")
        async with self.admitted() as version:
            with transport_errors("SGLang /generate"):
                resp = await self.client.post(
                    "/generate", json=generate_payload(request, stream=False)
                )
            check_status(resp.status_code, resp.text, "SGLang /generate")
            body = json_body(resp, "SGLang /generate")
        meta = (body.get("meta_info") if isinstance(body, dict) else None) or {}
        pairs = token_logprobs(meta)
        finish = finish_of(meta)
        if finish is None or not pairs:
            raise BackendError(f"SGLang /generate answered without tokens: {str(body)[:200]}")
        return GenerateResult([t for t, _ in pairs], [lp for _, lp in pairs], finish, version)

    def start_stream(self, request: GenerateRequest) -> SGLangStream:
        if not request.prompt_token_ids:
            raise BackendError("empty prompt")
        return SGLangStream(self, request)

    async def load_weights(self, checkpoint_dir: Path, version: int) -> None:
        async with self._swap_lock:
            self._admitting.clear()
            try:
                await self._drain()
                await self._control("/pause_generation", {})
                try:
                    body = await self._control(
                        "/update_weights_from_disk",
                        {"model_path": str(checkpoint_dir), "weight_version": str(version)},
                    )
                    if not (isinstance(body, dict) and body.get("success")):
                        raise BackendError(f"SGLang refused the weights: {body}")
                    self._version = version
                finally:
                    await self._control("/continue_generation", {})
            finally:
                self._admitting.set()
        logger.info("SGLang at %s serves version %d", self.config.base_url, version)

    async def health(self) -> bool:
        try:
            resp = await self.client.get("/health", timeout=self.config.connect_timeout_s)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def close(self) -> None:
        await self.client.aclose()

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_timeout_s
        while self._in_flight and loop.time() < deadline:
            await asyncio.sleep(0.01)
        if self._in_flight:
            logger.warning(
                "%d requests still running at swap: they will be aborted", self._in_flight
            )

    async def _control(self, path: str, body: dict[str, Any]) -> Any:
        with transport_errors(f"SGLang {path}"):
            resp = await self.client.post(path, json=body, timeout=self.config.control_timeout_s)
        check_status(resp.status_code, resp.text, f"SGLang {path}")
        return json_body(resp, f"SGLang {path}") if resp.content else None
