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
  (``model_path``, ``weight_version``, ``flush_cache``; answers ``success``,
  ``message``), ``POST /continue_generation``: the documented order for a
  weight update. ``/pause_generation`` takes ``mode`` (`PauseGenerationReqInput`):
  ``"abort"`` (SGLang's default) aborts every request on the server,
  ``"in_place"`` freezes them with their KV cache kept (a cache flush then
  fails while any is running, so the reload is sent ``flush_cache: false``),
  ``"retract"`` sends them back to the waiting queue, their KV cache freed
  and recomputed after ``/continue_generation``.
* ``GET /health``.
* LoRA adapters (server started with ``--enable-lora``, ``--max-lora-rank``,
  ``--lora-target-modules``): ``POST /load_lora_adapter`` (``lora_name``,
  ``lora_path``) and ``POST /unload_lora_adapter`` (``lora_name``), each
  answering ``success`` and ``error_message`` (400 when it failed); a
  ``/generate`` request samples with an adapter when ``lora_path`` names it.
  SGLang has no in-place reload: replacing an adapter is an unload, then a
  load under the same name (which SGLang gives a fresh internal id, so
  nothing cached for the old weights is reused).

* Weights over a collective (`weight_sync: collective`, docs/weight-sync.md),
  between the same pause and continue: ``GET /get_server_info``
  (``tp_size``: the ranks that join), then the trainer opens a transfer in
  protocol "torch" (`inference.weight_wire.rlgate_weight_wire`), and
  ``POST /init_weights_update_group`` (``master_address``, ``master_port``,
  ``rank_offset``, ``world_size``, ``group_name``, ``backend``),
  ``POST /update_weights_from_distributed`` (``names``, ``dtypes``,
  ``shapes``, ``group_name``, ``flush_cache``, ``weight_version``) and
  ``POST /destroy_weights_update_group`` (``group_name``), each answering
  ``success`` and ``message``. Unlike rlgate's vLLM extension, SGLang loads
  each tensor as it arrives: a transfer that fails half way leaves the
  server between versions, so that failure takes the replica's load as
  failed and the weights are reloaded from disk when the version was saved.
  Tested only against a stand-in server here (tests/unit/test_sglang_collective.py).

Hot swap follows `inference.http_backend.HttpBackend`'s ordering contract
(including its drain timeout: stragglers are aborted, then the swap goes on).
A keep-mode swap pauses with ``mode: "retract"`` when `SwapPolicy.clear_kv`
(every token after the swap computed by the new weights alone) and
``"in_place"`` otherwise; a drain-mode swap sends the empty body it always
has, SGLang's default mode (``"abort"``: requests of other clients still
running are aborted; this client's are drained first). SGLang labels no
single tokens (its ``meta_info.weight_version`` is the label when an
answer is sent, not when each token was sampled), so `labels_tokens` is
False: every generation is a stream, and a keep-mode swap marks where the
new version began (`HttpBackend`). The pause modes are tested only against
the stand-in server (`inference.stub_server --flavor sglang`, which follows
the documented semantics): SGLang has no CPU build to test against here.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from inference.backend import BackendError
from inference.http_backend import Completion, HttpBackend, StreamEvent
from inference.http_common import check_status, json_body, transport_errors
from inference.launch import ServerConfig, base_command
from inference.types import FinishReason, GenerateRequest, SwapPolicy
from inference.weight_source import CollectiveSource, open_transfer


def generate_payload(request: GenerateRequest, stream: bool) -> dict[str, Any]:
    """The `/generate` body for one rlgate request."""
    p = request.params
    sampling: dict[str, Any] = {
        "max_new_tokens": p.max_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k or -1,  # SGLang's "off" is -1
    }
    if p.stop_token_ids:
        sampling["stop_token_ids"] = list(p.stop_token_ids)
    if p.stop:
        sampling["stop"] = list(p.stop)
    if p.seed is not None:
        sampling["sampling_seed"] = p.seed
    body: dict[str, Any] = {
        "input_ids": list(request.prompt_token_ids),
        "sampling_params": sampling,
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": stream,
    }
    if request.adapter is not None:
        body["lora_path"] = request.adapter  # a loaded adapter's name, despite the field's name
    return body


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


class SGLangBackend(HttpBackend):
    """Drives one SGLang server (the API subset: module docstring; swap order: `HttpBackend`)."""

    name = "SGLang"

    async def _complete(self, request: GenerateRequest) -> Completion:
        body = await self._post("/generate", generate_payload(request, stream=False))
        meta = (body.get("meta_info") if isinstance(body, dict) else None) or {}
        pairs = token_logprobs(meta)
        finish = finish_of(meta)
        if finish is None or not pairs:
            raise BackendError(f"SGLang /generate answered without tokens: {str(body)[:200]}")
        return Completion(pairs, finish)

    async def _stream_tokens(self, request: GenerateRequest) -> AsyncIterator[StreamEvent]:
        seen = 0  # tokens yielded so far; events may repeat them (cumulative streaming)
        async for event in self._events("/generate", generate_payload(request, stream=True)):
            meta = event.get("meta_info") or {}
            pairs = token_logprobs(meta)
            total = int(meta.get("completion_tokens", seen + len(pairs)))
            new = total - seen
            if new > len(pairs) or new < 0:
                raise BackendError("stream lost tokens: completion_tokens out of step")
            seen = total
            yield StreamEvent(pairs[len(pairs) - new :] if new else [], finish_of(meta))

    _kv_kept = False  # paused "in_place": a cache flush would fail while requests run

    async def _pause(self, policy: SwapPolicy) -> None:
        body: dict[str, Any] = {}  # drain: the server's default, as always
        if policy.mode == "keep":
            body["mode"] = "retract" if policy.clear_kv else "in_place"
        self._kv_kept = body.get("mode") == "in_place"
        await self._control("/pause_generation", json=body)

    async def _reload(self, checkpoint_dir: Path, version: int) -> None:
        body: dict[str, Any] = {"model_path": str(checkpoint_dir), "weight_version": str(version)}
        if self._kv_kept:
            body["flush_cache"] = False
        resp = await self._control("/update_weights_from_disk", json=body)
        answer = json_body(resp, "SGLang /update_weights_from_disk") if resp.content else None
        if not (isinstance(answer, dict) and answer.get("success")):
            raise BackendError(f"SGLang refused the weights: {answer}")

    async def _resume(self) -> None:
        self._kv_kept = False
        await self._control("/continue_generation", json={})

    async def _receive(self, source: CollectiveSource, version: int) -> None:
        info = json_body(await self._get("/get_server_info"), "SGLang /get_server_info")
        ranks = int(info.get("tp_size") or 1) if isinstance(info, dict) else 1
        secret = self.config.credentials.weight_sync_secret
        rdv, answer = await open_transfer(source, ranks, protocol="torch", secret=secret)
        names, dtypes, shapes = (list(c) for c in zip(*answer["tensors"], strict=True))
        group = {"group_name": rdv.group_name}
        await self._checked(
            "/init_weights_update_group",
            {
                "master_address": rdv.host,
                "master_port": rdv.port,
                "rank_offset": 1,
                "world_size": rdv.world_size,
                "backend": "gloo",
                **group,
            },
        )
        try:
            await self._checked(
                "/update_weights_from_distributed",
                {
                    "names": names,
                    "dtypes": dtypes,
                    "shapes": shapes,
                    # the prefix cache holds the old weights' KV, unless it is to be kept
                    "flush_cache": not self._kv_kept,
                    "weight_version": str(version),
                    **group,
                },
            )
        finally:
            with contextlib.suppress(BackendError):  # older servers keep the group: harmless
                await self._checked("/destroy_weights_update_group", group)

    async def _checked(self, path: str, body: dict[str, Any]) -> None:
        """A control call whose answer must say `success`."""
        resp = await self._control(path, json=body)
        answer = json_body(resp, f"SGLang {path}") if resp.content else None
        if not (isinstance(answer, dict) and answer.get("success")):
            raise BackendError(f"SGLang {path} failed: {answer}")

    async def _get(self, path: str) -> httpx.Response:
        with transport_errors(f"{self.name} at {self.url}"):
            resp = await self._client.get(path, timeout=self.config.control_timeout_s)
        check_status(resp.status_code, resp.text, f"{self.name} GET {path}")
        return resp

    async def _load_adapter(self, name: str, adapter_dir: Path, replace: bool) -> None:
        if replace:  # no in-place reload in SGLang: not atomic (HttpBackend forgets it on failure)
            # A server that restarted no longer has it; any other failure fails the load below.
            with contextlib.suppress(BackendError):
                await self._unload_adapter(name)
        await self._lora_call(
            "/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter_dir)}
        )

    async def _unload_adapter(self, name: str) -> None:
        await self._lora_call("/unload_lora_adapter", {"lora_name": name})

    async def _lora_call(self, path: str, body: dict[str, Any]) -> None:
        resp = await self._control(path, json=body)
        answer = json_body(resp, f"SGLang {path}") if resp.content else None
        if not (isinstance(answer, dict) and answer.get("success")):
            raise BackendError(f"SGLang {path} failed: {answer}")


def server_command(cfg: ServerConfig) -> list[str]:
    """`sglang.launch_server` with the flags this backend relies on."""
    cmd = base_command(cfg, "sglang.launch_server", "--model-path", "--context-length")
    cmd.append("--skip-tokenizer-init")  # token ids in, token ids out
    if cfg.api_key:  # guards every route but /health and /metrics
        cmd += ["--api-key", cfg.api_key]
    if cfg.enable_lora:  # adapters come at runtime, so rank and modules cannot be inferred
        cmd += ["--enable-lora", "--max-loras-per-batch", str(cfg.max_loras)]
        cmd += ["--max-lora-rank", str(cfg.max_lora_rank), "--lora-target-modules", "all"]
    return cmd
