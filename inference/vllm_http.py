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

Hot swap follows `inference.http_backend.HttpBackend`'s ordering contract;
the server calls are `/pause?mode=wait&clear_cache=true` (which also drains
requests from other clients and clears the prefix cache, whose KV was
computed by the old weights), `/collective_rpc` `reload_weights` (in place),
`/update_weight_version` (informative) and `/resume`.

Weights over a collective (`weight_sync: collective`, docs/weight-sync.md):
the same pause and resume around `_receive`, which asks the trainer to open
a transfer for every worker of the server (counted once, by a
`/collective_rpc` that each worker answers) and has them join it through
rlgate's worker extension (`--worker-extension-cls
rlgate_vllm_ext.WeightReceiver`, `inference/weight_wire/`), which receives
over gloo and reloads in place. vLLM's own weight-transfer API
(`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update`) has only CUDA engines (`nccl`, `ipc`) in 0.32.

LoRA adapters (vLLM's runtime LoRA API; the server runs with `--enable-lora`
and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`, which `rlgate inference serve
--enable-lora` sets). A request for adapter `name` is sent with
`"model": name`. `load_adapter` posts `/v1/load_lora_adapter` with
`load_inplace: true`: vLLM (0.32) then keeps the adapter's LoRA int id,
loads the new weights first and swaps them for the old ones in its adapter
cache, so a failed load leaves the old adapter served. Its prefix cache keys
an adapter's blocks by (name, path), not by weights: a reload from a new
directory (what rlgate's checkpoints are, one per version) never reuses the
old weights' KV, but a reload from the directory already served would. That
case pauses the server with its prefix cache cleared, as a weight swap
does. `/v1/unload_lora_adapter` only removes the name from vLLM's API
server: the engine keeps the weights cached until its LRU (`--max-cpu-loras`,
default `--max-loras`) evicts them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from inference.backend import BackendError
from inference.http_backend import HttpBackend, Tokens
from inference.http_common import check_status, json_body, transport_errors
from inference.launch import ServerConfig, base_command
from inference.types import FinishReason, GenerateRequest
from inference.weight_source import WIRE_DIR, CollectiveSource, open_transfer

logger = logging.getLogger(__name__)

# Server flags this backend relies on (`rlgate inference serve` passes them).
REQUIRED_SERVER_ARGS = ("--logprobs-mode", "processed_logprobs", "--generation-config", "vllm")
WORKER_EXTENSION = "rlgate_vllm_ext.WeightReceiver"  # in WIRE_DIR, on the server's PYTHONPATH


def completion_body(model: str, request: GenerateRequest, stream: bool) -> dict[str, Any]:
    """The `/v1/completions` body for one request (vLLM's extensions after `logprobs`).

    `model` is the served base model's name; a request naming an adapter names it instead.
    """
    p = request.params
    body: dict[str, Any] = {
        "model": request.adapter or model,
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
        "top_k": p.top_k,  # 0 is off, even where a model's generation_config sets one
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


_FINISHES: dict[str | None, FinishReason] = {"stop": "stop", "length": "length"}


def _finish(reason: str | None) -> FinishReason:
    if reason in _FINISHES:
        return _FINISHES[reason]
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


class VLLMBackend(HttpBackend):
    """One vLLM server (the swap ordering: `HttpBackend`)."""

    name = "vLLM"
    adapter_reload_atomic = True  # load_inplace: the new weights load before the old go

    _model: str | None = None
    _workers: int | None = None  # the server's workers (tensor x pipeline parallel ranks)
    _max_model_len: int | None = None
    # (adapter, path) pairs this backend has had vLLM load: its prefix cache may hold their KV
    _adapter_paths: set[tuple[str, str]] | None = None

    async def server_info(self) -> tuple[str, int]:
        """(served model name, max_model_len) from `/v1/models`; cached."""
        if self._model is None or self._max_model_len is None:
            with transport_errors(f"vLLM at {self.url}"):
                resp = await self._client.get("/v1/models", timeout=self.config.control_timeout_s)
            check_status(resp.status_code, resp.text, "GET /v1/models")
            models = json_body(resp, "GET /v1/models").get("data") or []
            if not models:
                raise BackendError(f"vLLM at {self.url} serves no model")
            wanted = self._model or self.config.model
            entry = next((m for m in models if m.get("id") == wanted), models[0])
            self._model = str(entry["id"])
            self._max_model_len = int(entry.get("max_model_len") or 0) or None
        return self._model, self._max_model_len or 0

    async def served_context(self) -> int | None:
        """vLLM's --max-model-len, from `/v1/models`."""
        return (await self.server_info())[1] or None

    async def _complete(self, request: GenerateRequest) -> tuple[Tokens, FinishReason]:
        model, _ = await self.server_info()
        answer = await self._post("/v1/completions", completion_body(model, request, False))
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not choices:
            raise BackendError("vLLM answered without a choice")
        ids, lps, reason = parse_choice(choices[0])
        return list(zip(ids, lps, strict=True)), _finish(reason)

    async def _stream_tokens(
        self, request: GenerateRequest
    ) -> AsyncIterator[tuple[Tokens, FinishReason | None]]:
        model, _ = await self.server_info()
        async for event in self._events("/v1/completions", completion_body(model, request, True)):
            for choice in event.get("choices") or []:
                ids, lps, reason = parse_choice(choice)
                yield list(zip(ids, lps, strict=True)), _finish(reason) if reason else None

    async def _check_checkpoint(self, checkpoint_dir: Path, version: int) -> Path:
        # vLLM's engine dies on a reload from a missing or empty directory: check first.
        checkpoint_dir = checkpoint_dir.resolve()
        if not await asyncio.to_thread(lambda: any(checkpoint_dir.glob("*.safetensors"))):
            raise BackendError(f"no *.safetensors in {checkpoint_dir}; v{version} not loaded")
        return checkpoint_dir

    async def _pause(self) -> None:
        await self._control("/pause", params={"mode": "wait", "clear_cache": "true"})

    async def _reload(self, checkpoint_dir: Path, version: int) -> None:
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(checkpoint_dir)}}
        await self._control("/collective_rpc", json=rpc)
        with contextlib.suppress(BackendError):  # informative only
            await self._control("/update_weight_version", json={"new_version": str(version)})

    async def _resume(self) -> None:
        await self._control("/resume")

    async def _receive(self, source: CollectiveSource, version: int) -> None:
        if self._workers is None:
            resp = await self._control("/collective_rpc", json={"method": "rlgate_worker_rank"})
            self._workers = len(json_body(resp, "vLLM /collective_rpc").get("results") or [])
            if not self._workers:
                raise BackendError(f"vLLM at {self.url}: no worker answered /collective_rpc")
        secret = self.config.credentials.weight_sync_secret
        rdv, _ = await open_transfer(source, self._workers, secret=secret)
        kwargs = {"rendezvous": json.dumps(rdv.to_json())}
        resp = await self._control(
            "/collective_rpc", json={"method": "rlgate_receive_weights", "kwargs": kwargs}
        )
        for i, r in enumerate(json_body(resp, "vLLM /collective_rpc").get("results") or []):
            if isinstance(r, dict):  # the worker's figures
                logger.info(
                    "vLLM at %s worker %d: v%d, %d bytes received in %.2fs, loaded in %.2fs",
                    self.url, i, version, r.get("bytes", 0),
                    r.get("receive_s", 0.0), r.get("load_s", 0.0),
                )  # fmt: skip
        with contextlib.suppress(BackendError):  # informative only
            await self._control("/update_weight_version", json={"new_version": str(version)})

    async def _load_adapter(self, name: str, adapter_dir: Path, replace: bool) -> None:
        seen = self._adapter_paths = self._adapter_paths or set()
        key = (name, str(adapter_dir))
        body = {"lora_name": name, "lora_path": str(adapter_dir), "load_inplace": True}
        if key in seen:  # its prefix-cache blocks may hold the old weights' KV (docstring)
            async with self._server_paused():  # /pause clears the prefix cache
                await self._lora_call("/v1/load_lora_adapter", body)
        else:
            await self._lora_call("/v1/load_lora_adapter", body)
        seen.add(key)

    async def _unload_adapter(self, name: str) -> None:
        # 404 "cannot be found": the server no longer has it (it restarted), which is the goal.
        await self._lora_call("/v1/unload_lora_adapter", {"lora_name": name}, missing_ok=True)

    async def _lora_call(self, path: str, body: dict[str, Any], missing_ok: bool = False) -> None:
        """A runtime LoRA call; a server started without the LoRA API gets a hint."""
        with transport_errors(f"vLLM at {self.url}"):
            resp = await self._client.post(path, json=body, timeout=self.config.control_timeout_s)
        if resp.status_code == 404 and resp.headers.get("content-type", "").startswith(
            "application/json"
        ):
            if "detail" in json_body(resp, f"POST {path}"):  # FastAPI's answer: no such route
                raise BackendError(
                    f"vLLM at {self.url} has no {path}: start it with --enable-lora and "
                    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (rlgate inference serve --enable-lora)"
                )
            if missing_ok:
                return
        check_status(resp.status_code, resp.text, f"vLLM POST {path}")


def server_command(cfg: ServerConfig) -> list[str]:
    """`vllm.entrypoints.openai.api_server` with the flags this backend relies on."""
    module = "vllm.entrypoints.openai.api_server"
    cmd = [*base_command(cfg, module, "--model", "--max-model-len"), "--max-logprobs", "20"]
    cmd += [*REQUIRED_SERVER_ARGS, *(["--enforce-eager"] if cfg.enforce_eager else [])]
    cmd += ["--worker-extension-cls", WORKER_EXTENSION]
    if cfg.enable_lora:
        cmd += ["--enable-lora", "--max-loras", str(cfg.max_loras)]
        cmd += ["--max-lora-rank", str(cfg.max_lora_rank)]
    return cmd


def server_env(cfg: ServerConfig, env: dict[str, str]) -> None:
    """Add what vLLM needs to the server's environment `env`."""
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc (reload_weights), /reset_prefix_cache
    env["PYTHONPATH"] = str(WIRE_DIR)  # the worker extension (never rlgate's environment)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.kv_cache_gb))
    if cfg.api_key:  # --api-key's value, kept out of the command line (ps shows that)
        env["VLLM_API_KEY"] = cfg.api_key
    if cfg.enable_lora:  # /v1/load_lora_adapter, /v1/unload_lora_adapter
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
