"""A `Backend` over one vLLM OpenAI-compatible server: token ids in, ids and logprobs out.

Requests go to vLLM's token-in/token-out API, `POST /inference/v1/generate`
(the server runs with `--enable-scale-out`; `rlgate inference serve` passes
it: a plain `vllm serve` answers 403 there). It takes the prompt as token ids
and vLLM's own sampling parameters, so nothing is re-tokenized on either
side, and it labels every output token with the server's weights label
(`weight_versions`, on the answer and on a stream's last chunk), which is
what makes a keep-mode swap exact (below). Everything `/v1/completions` did
works there the same (checked against the real server in
tests/integration/test_vllm_keep_swap.py): the sampled token's logprob,
stop strings and stop token ids, seeds, top_k, and an adapter named by
`model`. Sampling parameters map 1:1; everything vLLM would otherwise take
from the model's `generation_config.json` (top_k, min_p, penalties) is
pinned to neutral, and stopping follows the local backend: on the request's
stop token ids (the model's EOS counts only through them) and stop strings,
the stopping token included in the output ids.

Logprobs. rlgate reports log softmax(logits / temperature) of each sampled
token (before top-p), what the trainer recomputes. vLLM reports that only with
`--logprobs-mode processed_logprobs` (its default, `raw_logprobs`, ignores the
temperature); `rlgate inference serve` passes it. With top_p < 1 vLLM's
processed logprobs are renormalized over the kept tokens (docs/backends.md).

Hot swap follows `inference.http_backend.HttpBackend`'s ordering contract.
`_pause` is `/pause?mode=keep&clear_cache=<clear_kv>` for a keep-mode swap:
vLLM freezes every running request between two tokens (every client's);
`clear_cache=true` also preempts them and drops the prefix cache, so after
`/resume` their KV is recomputed by the new weights and every later token
is computed by them alone; `false` keeps the old weights' KV. A drain-mode
swap pauses with `mode=wait&clear_cache=true` (which also drains requests
from other clients and clears the prefix cache, whose KV the old weights
computed). The reload is `/collective_rpc` `reload_weights` (in place).

Weights labels. Just before `/resume`, still paused, the backend labels the
server's weights (`/update_weight_version`) with the version of every lane
it serves: `{"base": 3, "lora": {"run-a": 5}}` (compact JSON, adapters
sorted; `ServerLabel`); also after each adapter load, before the adapter's
gate opens, and before the first call unless the server's label already
gives each lane of this client its version (a server that no swap of ours
has labelled, or one that another run labelled). vLLM stamps
each token with the label current when its engine step ran, so a token
sampled before the pause keeps the old label even when it reaches us after
the swap. A request maps its spans to the
version of its own lane (the base weights, or its adapter: `lane_starts`),
so one label serves every client of the server: other gateway processes
(the label is read, `GET /weight_info`, and only this client's lanes are
rewritten) and other adapters, whose requests see the label change while
their own version stays (one span). A label newer than this client's lane
is another process's reload (the swap barrier: this client adopts the
version only after the server resumed) and counts. A label that is not
rlgate's, lacks the lane, or goes back gives no starts: the result then
falls back to the marks
`HttpBackend` takes at the swap. Two clients rewriting the label at the
same moment (swaps of different adapters on one server from two processes)
can lose one's lane; its requests then fall back the same way (a
non-streaming call that spans a swap then fails with `BackendError`).

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
cache, so a failed load leaves the old adapter served.

An adapter is always replaced in drain mode, whatever the policy asks: the
adapter's requests in flight finish on the old weights while its new ones
wait, and the other adapters and the base model go on without a pause. A
keep-mode replacement cannot be exact on vLLM 0.32: each request carries the
`LoRARequest` it was admitted with (the old path, `load_inplace`), and the
engine re-applies that adapter in place when it schedules the request, so a
request running across the swap goes on with the OLD weights (after a
keep-mode pause its logprobs differed from the old adapter's by 0.0 and from
the new one's by up to 1.5), and sharing a batch with a new request it would swap the
weights back under it. What a keep pause would have cost the other adapters
(measured with a rank-8 SmolLM2-135M adapter on 2 busy CPU cores): one stall
of about 0.2 s (the pause waits for the engine step in flight, then the load
and the label), plus with `clear_kv` the recomputation of their KV (their
longest gap between two tokens 0.4-0.9 s against a median of 0.15 s;
tests/integration/test_vllm_keep_swap.py checks the drain and logs the
other adapter's stall). vLLM's prefix cache keys an adapter's blocks by
(name, path), not by weights: a reload from a new directory (what rlgate's
checkpoints are, one per version) never reuses the old weights' KV, but a
reload from the directory already served would. That case pauses the server
with its prefix cache cleared, as a drain-mode weight swap does.
`/v1/unload_lora_adapter` only removes the name from
vLLM's API server: the engine keeps the weights cached until its LRU
(`--max-cpu-loras`, default `--max-loras`) evicts them.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inference.backend import BackendError
from inference.http_backend import Completion, HttpBackend, StreamEvent
from inference.http_common import check_status, json_body, transport_errors
from inference.launch import ServerConfig, base_command
from inference.types import DRAIN, KEEP, FinishReason, GenerateRequest, SwapPolicy, VersionStarts
from inference.weight_source import WIRE_DIR, CollectiveSource, open_transfer

logger = logging.getLogger(__name__)

# Server flags this backend relies on (`rlgate inference serve` passes them).
REQUIRED_SERVER_ARGS = (
    "--logprobs-mode", "processed_logprobs",
    "--generation-config", "vllm",
    "--enable-scale-out",  # /inference/v1/generate
)  # fmt: skip
WORKER_EXTENSION = "rlgate_vllm_ext.WeightReceiver"  # in WIRE_DIR, on the server's PYTHONPATH
GENERATE = "/inference/v1/generate"


def sampling_params(request: GenerateRequest) -> dict[str, Any]:
    """vLLM's `SamplingParams` for one request, as `/inference/v1/generate` takes them."""
    p = request.params
    params: dict[str, Any] = {
        "n": 1,
        "max_tokens": p.max_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k,  # 0 is off, even where a model's generation_config sets one
        "min_p": 0.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "logprobs": 0,  # the sampled token's logprob only
        "ignore_eos": True,  # stop on the template's stop ids only, like the local backend
        "stop_token_ids": list(p.stop_token_ids),
        "include_stop_str_in_output": True,  # the gateway truncates the text itself
        "skip_special_tokens": False,
    }
    if p.stop:
        params["stop"] = list(p.stop)
    if p.seed is not None:
        params["seed"] = p.seed
    return params


def generate_body(model: str, request: GenerateRequest, stream: bool) -> dict[str, Any]:
    """The `/inference/v1/generate` body for one request.

    `model` is the served base model's name; a request naming an adapter names it instead.
    """
    return {
        "model": request.adapter or model,
        "token_ids": list(request.prompt_token_ids),
        "sampling_params": sampling_params(request),
        "stream": stream,
    }


def completion_body(model: str, request: GenerateRequest, stream: bool) -> dict[str, Any]:
    """The equivalent `/v1/completions` body (the same sampling, no per-token weights labels;
    for a server without `--enable-scale-out`, and the tests that compare the two)."""
    return {
        "model": request.adapter or model,
        "prompt": list(request.prompt_token_ids),
        "stream": stream,
        "return_token_ids": True,  # vLLM's extension, as are several sampling params
        **sampling_params(request),
    }


_FINISHES: dict[str | None, FinishReason] = {"stop": "stop", "length": "length"}


def _finish(reason: str | None) -> FinishReason:
    if reason in _FINISHES:
        return _FINISHES[reason]
    raise BackendError(f"generation ended with finish_reason {reason!r}")


def parse_choice(choice: dict[str, Any]) -> tuple[list[int], list[float], str | None]:
    """(token ids, logprobs, finish_reason) of one `/inference/v1/generate` choice or one
    streamed chunk of it."""
    try:
        ids = [int(t) for t in choice.get("token_ids") or []]
        content = (choice.get("logprobs") or {}).get("content") or []
        lps = [float(c["logprob"]) for c in content]
    except (TypeError, ValueError, KeyError) as exc:
        raise BackendError(f"malformed choice: {exc!r}") from exc
    if len(ids) != len(lps):
        raise BackendError(f"{len(ids)} token ids but {len(lps)} logprobs in a vLLM choice")
    return ids, lps, choice.get("finish_reason")


@dataclass(frozen=True)
class ServerLabel:
    """The weights label rlgate sets on a vLLM server: the version of each lane it serves.

    `encode` gives compact JSON, `{"base":3,"lora":{"run-a":5}}`; `decode` reads it back
    and gives None for any other label (vLLM's "default", another tool's).
    """

    base: int | None = None
    lora: Mapping[str, int] = field(default_factory=dict)

    def encode(self) -> str:
        return json.dumps(
            {"base": self.base, "lora": dict(sorted(self.lora.items()))}, separators=(",", ":")
        )

    @classmethod
    def decode(cls, text: object) -> ServerLabel | None:
        if not isinstance(text, str) or not text.startswith("{"):
            return None
        try:
            raw = json.loads(text)
            base, lora = raw.get("base"), raw.get("lora") or {}
            return cls(
                None if base is None else int(base), {str(k): int(v) for k, v in lora.items()}
            )
        except (ValueError, TypeError, AttributeError):
            return None

    def lane(self, adapter: str | None) -> int | None:
        """The version of the base weights (`adapter` None) or of adapter `adapter`."""
        return self.base if adapter is None else self.lora.get(adapter)

    def merged(self, base: int, adapters: Mapping[str, int]) -> ServerLabel:
        """This label with one client's lanes written over it (other clients' lanes stay)."""
        return ServerLabel(base, {**self.lora, **adapters})


def lane_starts(spans: object, adapter: str | None, n_tokens: int) -> VersionStarts | None:
    """Where each version of the request's lane began, from vLLM's `weight_versions`
    (`[{"version": label, "start", "end"}, ...]`) for an output of `n_tokens` tokens.

    None (the caller falls back to its own marks) when there are no spans, when a span's
    label gives no version for the lane (not a `ServerLabel`, or it lacks the lane), or
    when a version is older than the one before it. A version newer than this client's
    lane is kept: another gateway process reloaded the server (the swap barrier), and
    this client adopts that version only after the server resumed. A label left by
    another run is not taken for ours: each client rewrites its lanes before its first
    call (`VLLMBackend.server_info`).
    """
    if not isinstance(spans, list) or not spans or n_tokens == 0:
        return None
    starts: list[tuple[int, int]] = []
    try:
        for span in spans:
            label = ServerLabel.decode(span.get("version"))
            version = None if label is None else label.lane(adapter)
            if version is None:
                return None
            if starts and version < starts[-1][1]:
                logger.warning(
                    "vLLM weights label %r goes back on lane %r; using marks",
                    span.get("version"), adapter,
                )  # fmt: skip
                return None
            if not starts or version != starts[-1][1]:
                starts.append((int(span["start"]), version))
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    if starts[0][0] != 0 or starts[-1][0] >= n_tokens:
        return None
    return tuple(starts)


class VLLMBackend(HttpBackend):
    """One vLLM server (the swap ordering: `HttpBackend`)."""

    name = "vLLM"
    adapter_reload_atomic = True  # load_inplace: the new weights load before the old go
    labels_tokens = True  # /inference/v1/generate's weight_versions, mapped by lane_starts

    _model: str | None = None
    _workers: int | None = None  # the server's workers (tensor x pipeline parallel ranks)
    _max_model_len: int | None = None
    # (adapter, path) pairs this backend has had vLLM load: its prefix cache may hold their KV
    _adapter_paths: set[tuple[str, str]] | None = None
    _loading: dict[str, int] | None = None  # adapter -> the version `load_adapter` is loading
    _label_lock: asyncio.Lock | None = None  # one label rewrite at a time in this client
    _labelled = False  # the first sampling call has checked the server's label

    async def server_info(self) -> tuple[str, int]:
        """(served model name, max_model_len) from `/v1/models`; cached. The first call also
        labels the server's weights unless its label already gives each of this client's
        lanes the version the client serves (a server no swap of ours has labelled yet, or
        one another run labelled), so that every token's label is this run's."""
        if not self._labelled:
            self._labelled = True
            await self._label(unless_current=True)
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

    async def _complete(self, request: GenerateRequest) -> Completion:
        model, _ = await self.server_info()
        answer = await self._post(GENERATE, generate_body(model, request, False))
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not choices:
            raise BackendError("vLLM answered without a choice")
        ids, lps, reason = parse_choice(choices[0])
        starts = self._starts(request, choices[0], len(ids))
        return Completion(list(zip(ids, lps, strict=True)), _finish(reason), starts)

    async def _stream_tokens(self, request: GenerateRequest) -> AsyncIterator[StreamEvent]:
        model, _ = await self.server_info()
        n = 0
        async for event in self._events(GENERATE, generate_body(model, request, True)):
            for choice in event.get("choices") or []:
                ids, lps, reason = parse_choice(choice)
                n += len(ids)
                starts = None
                if choice.get("weight_versions") is not None:  # the last chunk: all of it
                    starts = self._starts(request, choice, n)
                finish = _finish(reason) if reason else None
                yield StreamEvent(list(zip(ids, lps, strict=True)), finish, starts)

    def _starts(
        self, request: GenerateRequest, choice: dict[str, Any], n_tokens: int
    ) -> VersionStarts | None:
        """The request's version starts from the choice's weights labels (`lane_starts`)."""
        return lane_starts(choice.get("weight_versions"), request.adapter, n_tokens)

    async def _check_checkpoint(self, checkpoint_dir: Path, version: int) -> Path:
        # vLLM's engine dies on a reload from a missing or empty directory: check first.
        checkpoint_dir = checkpoint_dir.resolve()
        if not await asyncio.to_thread(lambda: any(checkpoint_dir.glob("*.safetensors"))):
            raise BackendError(f"no *.safetensors in {checkpoint_dir}; v{version} not loaded")
        return checkpoint_dir

    async def _pause(self, policy: SwapPolicy) -> None:
        if policy.mode == "keep":
            clear = "true" if policy.clear_kv else "false"
            await self._control("/pause", params={"mode": "keep", "clear_cache": clear})
        else:
            await self._control("/pause", params={"mode": "wait", "clear_cache": "true"})

    async def _reload(self, checkpoint_dir: Path, version: int) -> None:
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(checkpoint_dir)}}
        await self._control("/collective_rpc", json=rpc)

    async def _resume(self) -> None:
        """Label the weights (still paused, so no token is sampled between), then resume;
        a failed label still resumes, and then raises."""
        try:
            await self._label()
        finally:
            await self._control("/resume")

    async def _label(self, unless_current: bool = False) -> None:
        """Write this client's lanes over the server's label: the base `version`, and each
        adapter's (the version being loaded, for one `load_adapter` is loading).
        `unless_current`: leave a label that gives every lane of this client its version."""
        lock = self._label_lock = self._label_lock or asyncio.Lock()
        async with lock:
            adapters = {**self.adapters, **(self._loading or {})}
            with transport_errors(f"vLLM at {self.url}"):
                resp = await self._client.get("/weight_info", timeout=self.config.control_timeout_s)
            current = None
            if resp.status_code == 200:
                text = json_body(resp, "GET /weight_info").get("weight_version")
                current = ServerLabel.decode(text)
            if (
                unless_current
                and current
                and current.lane(None) == self.version
                and all(current.lane(name) == v for name, v in adapters.items())
            ):
                return
            label = (current or ServerLabel()).merged(self.version, adapters)
            await self._control("/update_weight_version", json={"new_version": label.encode()})

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

    async def load_adapter(
        self, name: str, adapter_dir: Path, version: int, policy: SwapPolicy = KEEP
    ) -> None:
        """`HttpBackend.load_adapter` in drain mode (the module docstring says why), with
        `version` known to `_load_adapter`'s label."""
        if policy.mode == "keep" and self.adapter_version(name) is not None:
            logger.debug("vLLM at %s: adapter %r v%d replaced draining", self.url, name, version)
            policy = DRAIN
        loading = self._loading = self._loading or {}
        loading[name] = version
        try:
            await super().load_adapter(name, adapter_dir, version, policy)
        finally:
            loading.pop(name, None)

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
        # Before its lane opens at the new version (a keep-mode load is still paused; a
        # drain-mode one has none of its requests in flight): its requests label right.
        await self._label()

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
    # /pause, /resume, /collective_rpc (reload_weights), /update_weight_version, /weight_info
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env["PYTHONPATH"] = str(WIRE_DIR)  # the worker extension (never rlgate's environment)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.kv_cache_gb))
    if cfg.api_key:  # --api-key's value, kept out of the command line (ps shows that)
        env["VLLM_API_KEY"] = cfg.api_key
    if cfg.enable_lora:  # /v1/load_lora_adapter, /v1/unload_lora_adapter
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
