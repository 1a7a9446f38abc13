"""A `Backend` over one vLLM OpenAI-compatible server: token ids in, ids and logprobs out.

Requests go to `/v1/completions` with the prompt as token ids and
`return_token_ids`, so nothing is re-tokenized on either side. Sampling
parameters map 1:1; everything vLLM would otherwise take from the model's
`generation_config.json` (top_k, min_p, penalties) is pinned to neutral, and
stopping follows the local backend: on the request's stop token ids (the
model's EOS counts only through them) and stop strings, the stopping token
included in the output ids.

Logprobs. rlgate reports log softmax(logits / temperature) of each sampled
token (before top-p), what the trainer recomputes. vLLM reports that only with
`--logprobs-mode processed_logprobs` (its default, `raw_logprobs`, ignores the
temperature); `rlgate inference serve` passes it. With top_p < 1 vLLM's
processed logprobs are renormalized over the kept tokens (docs/backends.md).

Hot swap, the ordering contract. `load_weights` closes this backend's gate
(new requests wait, nothing fails), waits until every request it admitted has
finished, pauses the server (`/pause?mode=wait`, which also drains requests
from other clients and clears the prefix cache, whose KV was computed by the
old weights), reloads in place (`/collective_rpc` `reload_weights`), resumes,
then opens the gate. No generation therefore spans a swap: the version a
request reads when it is admitted is the one that sampled all of its tokens.
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

# Server flags this backend relies on (`rlgate inference serve` passes them).
REQUIRED_SERVER_ARGS = ("--logprobs-mode", "processed_logprobs", "--generation-config", "vllm")


def completion_body(model: str, request: GenerateRequest, stream: bool) -> dict[str, Any]:
    """The `/v1/completions` body for one request (vLLM's extensions after `logprobs`)."""
    p = request.params
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(request.prompt_token_ids),
        "max_tokens": p.max_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "n": 1,
        "stream": stream,
        "logprobs": 0,  # the sampled token's logprob only
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        # --- vLLM extensions
        "return_token_ids": True,
        "top_k": 0,  # disabled (a model's generation_config may set one)
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "ignore_eos": True,  # stop on the template's stop ids only, like the local backend
        "stop_token_ids": list(p.stop_token_ids),
        "include_stop_str_in_output": True,  # the gateway truncates the text itself
        "skip_special_tokens": False,
    }
    if p.stop:
        body["stop"] = list(p.stop)
    if p.seed is not None:
        body["seed"] = p.seed
    return body


def _finish(reason: str | None) -> FinishReason:
    if reason in ("stop", "length"):
        return reason
    raise BackendError(f"generation ended with finish_reason {reason!r}")


def parse_choice(choice: dict[str, Any]) -> tuple[list[int], list[float], str | None]:
    """(token ids, logprobs, finish_reason) of one choice or one streamed chunk of it."""
    try:
        ids = [int(t) for t in choice.get("token_ids") or []]
        lps_raw = (choice.get("logprobs") or {}).get("token_logprobs") or []
        lps = [float(x) for x in lps_raw]
    except (TypeError, ValueError) as exc:
        raise BackendError(f"malformed choice: {exc}") from exc
    if len(ids) != len(lps):
        raise BackendError(
            f"{len(ids)} token ids but {len(lps)} logprobs: is the server started "
            "with return_token_ids support (vLLM >= 0.10)?"
        )
    return ids, lps, choice.get("finish_reason")


class VLLMBackend:
    """One vLLM server (see the module docstring for the swap ordering)."""

    def __init__(
        self,
        cfg: HttpBackendConfig,
        version: int = 0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.cfg = cfg
        self._client = make_client(cfg)
        if transport is not None:  # tests inject one
            self._client = httpx.AsyncClient(
                base_url=cfg.base_url, transport=transport, timeout=self._client.timeout
            )
        self._model = cfg.model
        self._max_model_len: int | None = None
        self._version = version
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._gate = asyncio.Event()  # cleared while a swap is under way
        self._gate.set()
        self._swap_lock = asyncio.Lock()

    @property
    def version(self) -> int:
        return self._version

    @property
    def url(self) -> str:
        return self.cfg.base_url

    async def server_info(self) -> tuple[str, int]:
        """(served model name, max_model_len) from `/v1/models`; cached."""
        if self._model is None or self._max_model_len is None:
            with transport_errors(f"vLLM at {self.url}"):
                resp = await self._client.get("/v1/models", timeout=self.cfg.control_timeout_s)
            check_status(resp.status_code, resp.text, "GET /v1/models")
            models = json_body(resp, "GET /v1/models").get("data") or []
            if not models:
                raise BackendError(f"vLLM at {self.url} serves no model")
            entry = next((m for m in models if m.get("id") == self._model), models[0])
            self._model = str(entry["id"])
            self._max_model_len = int(entry.get("max_model_len") or 0) or None
        return self._model, self._max_model_len or 0

    @contextlib.asynccontextmanager
    async def admitted(self) -> AsyncIterator[int]:
        """Hold a place among the in-flight requests; yields the version that will serve it."""
        await self._gate.wait()
        self._inflight += 1
        self._idle.clear()
        try:
            yield self._version
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if not request.prompt_token_ids:
            raise BackendError("empty prompt")
        model, _ = await self.server_info()
        async with self.admitted() as version:
            with transport_errors(f"vLLM at {self.url}"):
                resp = await self._client.post(
                    "/v1/completions", json=completion_body(model, request, stream=False)
                )
        check_status(resp.status_code, resp.text, "POST /v1/completions")
        choices = json_body(resp, "POST /v1/completions").get("choices") or []
        if not choices:
            raise BackendError("vLLM answered without a choice")
        ids, lps, reason = parse_choice(choices[0])
        return GenerateResult(ids, lps, _finish(reason), version)

    def start_stream(self, request: GenerateRequest) -> VLLMStream:
        if not request.prompt_token_ids:
            raise BackendError("empty prompt")
        return VLLMStream(self, request)

    async def load_weights(self, checkpoint_dir: Path, version: int) -> None:
        # vLLM's engine dies on a reload from a missing or empty directory: check first.
        checkpoint_dir = Path(checkpoint_dir).resolve()
        if not await asyncio.to_thread(lambda: any(checkpoint_dir.glob("*.safetensors"))):
            raise BackendError(f"no *.safetensors in {checkpoint_dir}; v{version} not loaded")
        async with self._swap_lock:
            self._gate.clear()
            try:
                try:
                    await asyncio.wait_for(self._idle.wait(), self.cfg.drain_timeout_s)
                except TimeoutError as exc:
                    raise BackendError(
                        f"{self._inflight} requests still running after "
                        f"{self.cfg.drain_timeout_s}s; swap to v{version} postponed"
                    ) from exc
                await self._control("/pause", params={"mode": "wait", "clear_cache": "true"})
                try:
                    await self._control(
                        "/collective_rpc",
                        json={
                            "method": "reload_weights",
                            "kwargs": {"weights_path": str(checkpoint_dir)},
                        },
                    )
                    self._version = version
                    with contextlib.suppress(BackendError):  # informative only
                        await self._control(
                            "/update_weight_version", json={"new_version": str(version)}
                        )
                finally:
                    await self._control("/resume")
                logger.info("%s now serves version %d (%s)", self.url, version, checkpoint_dir)
            finally:
                self._gate.set()

    async def _control(self, path: str, **kwargs: Any) -> None:
        with transport_errors(f"vLLM at {self.url}"):
            resp = await self._client.post(path, timeout=self.cfg.control_timeout_s, **kwargs)
        check_status(resp.status_code, resp.text, f"POST {path}")

    async def health(self) -> bool:
        try:
            resp = await self._client.get("/health", timeout=self.cfg.connect_timeout_s)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def close(self) -> None:
        await self._client.aclose()


class VLLMStream:
    """One streamed generation (see `inference.backend.TokenStream`).

    `cancel` closes the HTTP stream, which makes vLLM abort the request; the
    result keeps what arrived, with finish_reason "cancelled".
    """

    def __init__(self, backend: VLLMBackend, request: GenerateRequest) -> None:
        self._backend = backend
        self._request = request
        self._queue: asyncio.Queue[tuple[int, float] | None] = asyncio.Queue()
        self._ids: list[int] = []
        self._lps: list[float] = []
        self._version = backend.version
        self._task = asyncio.get_running_loop().create_task(self._run(), name="vllm-stream")

    async def _run(self) -> GenerateResult:
        try:
            model, _ = await self._backend.server_info()
            body = completion_body(model, self._request, stream=True)
            async with self._backend.admitted() as version:
                self._version = version
                reason = await self._receive(body)
            return GenerateResult(self._ids, self._lps, _finish(reason), self._version)
        except asyncio.CancelledError:
            return GenerateResult(self._ids, self._lps, "cancelled", self._version)
        finally:
            self._queue.put_nowait(None)

    async def _receive(self, body: dict[str, Any]) -> str | None:
        reason = None
        client = self._backend._client
        with transport_errors(f"vLLM at {self._backend.url}"):
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                await check_response(resp, "POST /v1/completions (stream)")
                async for event in iter_sse(resp):
                    for choice in event.get("choices") or []:
                        ids, lps, finish = parse_choice(choice)
                        for token, lp in zip(ids, lps, strict=True):
                            self._ids.append(token)
                            self._lps.append(lp)
                            self._queue.put_nowait((token, lp))
                        reason = finish or reason
        return reason

    async def tokens(self) -> AsyncIterator[tuple[int, float]]:
        while (item := await self._queue.get()) is not None:
            yield item

    def cancel(self) -> None:
        self._task.cancel()

    async def result(self) -> GenerateResult:
        return await asyncio.shield(self._task)
