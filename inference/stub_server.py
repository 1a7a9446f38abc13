"""A fixed-latency STAND-IN for a vLLM or SGLang server, for tests and benchmarks.

This is not vLLM or SGLang. It was written from their documented HTTP APIs
and implements only the subset rlgate uses, with no model behind it:

* ``--flavor vllm``: ``POST /v1/completions`` (token-id ``prompt``,
  ``return_token_ids``, ``logprobs``, ``stream``; ``model`` the served model
  or a loaded adapter's name), ``POST /inference/v1/generate`` (vLLM 0.32's
  token-in/token-out API: ``token_ids``, ``sampling_params``, ``model``,
  ``stream``; each choice's ``weight_versions`` labels every output token
  with the weight version label current when it was sampled, in the final
  chunk when streaming), ``GET /v1/models``, ``GET /health``,
  ``POST /pause`` (``mode`` ``keep`` or ``wait``, ``clear_cache``),
  ``POST /resume``, ``POST /collective_rpc`` with method
  ``reload_weights``, ``POST /update_weight_version`` (``new_version``:
  the label), ``GET /weight_info``, ``GET /is_paused``, and (unless
  ``--no-lora``) ``POST /v1/load_lora_adapter`` (``lora_name``,
  ``lora_path``, ``load_inplace``), ``POST /v1/unload_lora_adapter``;
  ``POST /v1/chat/completions`` answers text without a tokenizer (for
  proxies measured against the same backend, not for rlgate).
* ``--flavor sglang``: ``POST /generate`` (``input_ids``, ``sampling_params``,
  ``return_logprob``, ``stream``, ``lora_path`` naming a loaded adapter),
  ``GET /health``, ``GET /get_model_info``, ``POST /pause_generation``
  (``mode`` ``in_place`` or ``retract``), ``POST /continue_generation``,
  ``POST /update_weights_from_disk`` (``flush_cache``; with requests frozen
  ``in_place`` a flush fails, as SGLang documents), ``POST /load_lora_adapter``,
  ``POST /unload_lora_adapter``.

Pause modes. ``keep`` (vLLM) and ``in_place``/``retract`` (SGLang) freeze
the requests in flight between two tokens until the resume: no token is
sampled inside the pause (``/stub/state`` counts any that were, in
``tokens_while_paused``, so a benchmark can check 0), and the tokens after
it come from the weights loaded meanwhile. With no mode, or ``wait``, the
requests in flight go on (the caller drained its own; their tokens count in
``tokens_while_paused`` too) and only new ones wait. There is no KV cache:
``clear_cache`` and the two SGLang modes differ only in what ``/stub/state``
records (``pause``, ``last_pause``). vLLM's and SGLang's own default,
``abort``, is refused (400): nothing here uses it. Until a label is set,
tokens carry vLLM's first label, ``default``.

Output is deterministic: token i of a request is a function of the prompt,
i, the weights version and the adapter it names (its name and directory,
`adapter_salt`); its logprob likewise. Each request waits
``--latency-ms`` before its first token and ``--token-latency-ms`` between
tokens. With ``--max-running N`` a request beyond N in flight is answered
429 (vLLM's overload answer; 0 refuses every request). A weight reload
bumps the served version (``GET /stub/state`` shows it, with counters), and
the tokens change with it, so swap tests can see which weights answered.
While paused, new requests wait for resume. With ``--api-key K`` every route
but ``/health`` and ``/stub/state`` answers 401 unless the request carries
``Authorization: Bearer K`` (stricter than vLLM, whose key guards only
``/v1``: a test sees that the control calls carry the key too).

Run: ``python -m inference.stub_server --flavor vllm --port 8001 --latency-ms 50``.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import subprocess
import sys
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

logger = logging.getLogger(__name__)

FLAVORS = ("vllm", "sglang")  # the server APIs this stand-in speaks
FREEZING = ("keep", "in_place", "retract")  # pause modes that freeze requests between tokens
PAUSE_MODES = (*FREEZING, "wait")
OPEN_PATHS = ("/health", "/stub/state")  # answered without the API key


@dataclass
class StubConfig:
    """What the stand-in serves and how slowly."""

    flavor: str = "vllm"  # one of FLAVORS: which API to expose
    model: str = "stub-model"  # served model name (vLLM's /v1/models)
    latency_ms: float = 0.0  # wait before the first token of every request
    token_latency_ms: float = 0.0  # wait between two tokens
    output_tokens: int = 16  # tokens per answer unless max_tokens is lower
    vocab_size: int = 256  # token ids are drawn from [token_base, vocab_size)
    token_base: int = 100
    max_model_len: int = 2048
    version: int = 0  # weights version served at start
    incremental_streaming_output: bool = False  # sglang: stream only new tokens per event
    max_running: int = -1  # requests in flight beyond this get 429 (-1: no limit)
    lora: bool = True  # vllm: serve the runtime LoRA routes (as with VLLM_ALLOW_RUNTIME_LORA_...)
    api_key: str = ""  # required as a Bearer token on every route but OPEN_PATHS; "": none

    def __post_init__(self) -> None:
        if self.flavor not in FLAVORS:
            raise ValueError(f"flavor must be one of {FLAVORS}")
        if not 0 <= self.token_base < self.vocab_size:
            raise ValueError("token_base must be in [0, vocab_size)")


class StubState:
    """The served weights version, its label, the pause switch and counters."""

    def __init__(self, cfg: StubConfig) -> None:
        self.cfg = cfg
        self.version = cfg.version
        self.weights_path: str | None = None
        self.weight_version_label: str | None = None
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.pause: dict[str, Any] | None = None  # how it is paused now: mode and flags
        self.last_pause: dict[str, Any] | None = None  # the latest pause's, kept after it
        self.tokens_while_paused = 0  # sampled while paused: never, unless a pause is broken
        self.requests = 0
        self.in_flight = 0
        self.reloads = 0
        self.adapters: dict[str, str] = {}  # loaded LoRA adapters: name -> directory
        self.adapter_loads = 0
        self.refused = 0  # requests without the API key (401)

    def overloaded(self) -> JSONResponse | None:
        """The 429 a full server answers, when `max_running` requests are already in flight."""
        if 0 <= self.cfg.max_running <= self.in_flight:
            message = f"stub: {self.in_flight} requests running (max {self.cfg.max_running})"
            return JSONResponse({"error": {"message": message, "code": 429}}, 429)
        return None

    def token(self, prompt: list[int], i: int, salt: int = 0) -> tuple[int, float]:
        """Token i for `prompt` (`salt`: the adapter's `adapter_salt`, 0 for the base model)."""
        span = self.cfg.vocab_size - self.cfg.token_base
        seed = (sum(prompt) * 31 + len(prompt) * 17 + i * 7 + self.version * 13 + salt) % span
        return self.cfg.token_base + seed, -0.05 * (1 + (seed % 9))

    def salt_of(self, adapter: str | None) -> int | None:
        """The salt of a loaded adapter (0 for none); None if `adapter` is not loaded."""
        if adapter is None:
            return 0
        path = self.adapters.get(adapter)
        return None if path is None else adapter_salt(adapter, path)

    @property
    def label(self) -> str:
        """The weight version label tokens sampled now carry: the last one set
        (`/update_weight_version`, SGLang's `weight_version`), else "default", vLLM's
        label of the weights it started with (not a version number)."""
        return self.weight_version_label or "default"

    def frozen(self) -> bool:
        return self.pause is not None and self.pause["mode"] in FREEZING

    async def sample(
        self, prompt: list[int], max_tokens: int, stop_ids: set[int], adapter: str | None = None
    ) -> AsyncIterator[tuple[int, float, str | None, str]]:
        """(token, logprob, finish reason on the last token, weight version label) with the
        configured latencies; a freezing pause holds it between two tokens. Each token is
        sampled by the weights and `adapter` (a loaded one's name) served at that moment."""
        salt = self.salt_of(adapter) or 0
        await self.resumed.wait()
        self.requests += 1
        self.in_flight += 1
        try:
            await asyncio.sleep(self.cfg.latency_ms / 1000)
            n = max(1, min(max_tokens, self.cfg.output_tokens))
            for i in range(n):
                if i and self.cfg.token_latency_ms:
                    await asyncio.sleep(self.cfg.token_latency_ms / 1000)
                while self.frozen():
                    await self.resumed.wait()
                # nothing awaits from here to the yield: the pause cannot split a token
                if not self.resumed.is_set():
                    self.tokens_while_paused += 1
                salt = self.salt_of(adapter) or salt  # unloaded meanwhile: the last one
                tok, lp = self.token(prompt, i, salt)
                finish = "stop" if tok in stop_ids else ("length" if i == n - 1 else None)
                yield tok, lp, finish, self.label
                if finish:
                    return
        finally:
            self.in_flight -= 1

    def reload(self, path: str | None) -> None:
        self.version += 1
        self.reloads += 1
        self.weights_path = path
        logger.info("stub reloaded weights from %s: version %d", path, self.version)


def adapter_salt(name: str, path: str) -> int:
    """What an adapter changes in the stand-in's tokens: a function of its name and directory."""
    return zlib.crc32(f"{name}\n{path}".encode()) % 9973 + 1


def error(message: str, status: int, kind: str = "BadRequestError") -> JSONResponse:
    """An OpenAI-style error answer, as vLLM gives it."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)


def text_of(tok: int) -> str:
    return f" t{tok}"


def sse(event: dict[str, Any]) -> str:
    return f"data: {json.dumps(event, separators=(',', ':'))}\n\n"


def add_common_routes(app: FastAPI, state: StubState) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({})

    @app.get("/stub/state")
    async def stub_state() -> dict[str, Any]:
        return {
            "flavor": state.cfg.flavor,
            "version": state.version,
            "weights_path": state.weights_path,
            "weight_version": state.weight_version_label,
            "paused": not state.resumed.is_set(),
            "pause": state.pause,
            "last_pause": state.last_pause,
            "tokens_while_paused": state.tokens_while_paused,
            "requests": state.requests,
            "in_flight": state.in_flight,
            "reloads": state.reloads,
            "adapters": state.adapters,
            "adapter_loads": state.adapter_loads,
            "refused": state.refused,
        }


Tok = tuple[int, float]  # (token id, logprob)
Sample = AsyncIterator[tuple[int, float, str | None, str]]


def label_spans(labels: list[str]) -> list[dict[str, Any]]:
    """vLLM's `weight_versions`: contiguous [start, end) spans of output tokens per label."""
    spans: list[dict[str, Any]] = []
    for i, label in enumerate(labels):
        if spans and spans[-1]["version"] == label:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": label, "start": i, "end": i + 1})
    return spans


async def sampled_answer(
    sample: Sample,
    stream: bool,
    chunk: Callable[[list[Tok], str | None], dict],
    whole: Callable[[list[Tok], str], dict],
) -> Any:
    """What both flavors do with a sample: an SSE frame per token (`chunk` of the tokens so
    far) ending in `[DONE]`, or one body (`whole` of every token and the finish reason)."""
    if stream:

        async def events() -> AsyncIterator[str]:
            toks: list[Tok] = []
            async for tok, lp, finish, _ in sample:
                toks.append((tok, lp))
                yield sse(chunk(toks, finish))
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")
    toks: list[Tok] = []
    finish = "length"
    async for tok, lp, fin, _ in sample:
        toks.append((tok, lp))
        finish = fin or finish
    return whole(toks, finish)


def add_pause_routes(
    app: FastAPI,
    state: StubState,
    pause: str,
    resume: str,
    answer: Callable[[str], dict],
    mode_of: Callable[[Request], Awaitable[dict[str, Any]]],
) -> None:
    """The flavor's pause and resume paths (`answer` of "paused"/"continued": its body;
    `mode_of`: the pause's mode and flags from its request, mode None for the default)."""

    @app.post(pause)
    async def paused(request: Request) -> JSONResponse:
        how = await mode_of(request)
        mode = how["mode"] = how.get("mode") or "wait"
        if mode not in PAUSE_MODES:
            return error(f"stub: pause mode {mode!r} is not supported ({PAUSE_MODES})", 400)
        state.pause = state.last_pause = how
        state.resumed.clear()
        return JSONResponse(answer("paused"))

    @app.post(resume)
    async def resumed() -> JSONResponse:
        state.pause = None
        state.resumed.set()
        return JSONResponse(answer("continued"))


def add_vllm_routes(app: FastAPI, state: StubState) -> None:
    cfg = state.cfg

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": cfg.model, "object": "model", "owned_by": "stub"}
        loras = [
            {"id": name, "object": "model", "root": path, "parent": cfg.model}
            for name, path in state.adapters.items()
        ]
        return {"object": "list", "data": [{**card, "max_model_len": cfg.max_model_len}, *loras]}

    if cfg.lora:
        add_vllm_lora_routes(app, state)

    async def pause_query(request: Request) -> dict[str, Any]:
        clear = request.query_params.get("clear_cache", "true").lower() == "true"
        return {"mode": request.query_params.get("mode"), "clear_cache": clear}

    add_pause_routes(app, state, "/pause", "/resume", lambda _: {}, pause_query)

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request) -> JSONResponse:
        body = await request.json()
        if body.get("method") != "reload_weights":
            return JSONResponse({"error": {"message": "stub: only reload_weights"}}, 400)
        state.reload((body.get("kwargs") or {}).get("weights_path"))
        return JSONResponse({"results": [None]})

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> JSONResponse:
        body = await request.json() if await request.body() else {}
        if not isinstance(body.get("new_version"), str):
            return error("stub: new_version (a string) is required", 422)
        state.weight_version_label = body["new_version"]
        return JSONResponse({"success": True, "new_version": body["new_version"]})

    @app.get("/weight_info")
    async def weight_info() -> JSONResponse:
        return JSONResponse({"weight_version": state.label})

    @app.get("/is_paused")
    async def is_paused() -> JSONResponse:
        return JSONResponse({"is_paused": not state.resumed.is_set()})

    add_vllm_completions_route(app, state)
    add_vllm_generate_route(app, state)
    add_vllm_chat_route(app, state)


def add_vllm_completions_route(app: FastAPI, state: StubState) -> None:
    """`POST /v1/completions` on token ids, with vLLM's `return_token_ids` extension."""
    cfg = state.cfg

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        if (full := state.overloaded()) is not None:
            return full
        body = await request.json()
        prompt = body.get("prompt")
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            return error("stub: prompt must be a list of token ids", 400)
        model = body.get("model")
        adapter = None if model in (None, cfg.model) else model
        if state.salt_of(adapter) is None:
            return error(f"The model `{model}` does not exist.", 404, "NotFoundError")
        max_tokens = int(body.get("max_tokens") or 16)
        stop_ids = set(body.get("stop_token_ids") or [])
        want_lp = body.get("logprobs") is not None
        cid, created = "cmpl-" + uuid.uuid4().hex, int(time.time())

        def choice(toks: list[Tok], finish: str | None, first: bool) -> dict:
            c: dict[str, Any] = {
                "index": 0,
                "text": "".join(text_of(t) for t, _ in toks),
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
            if want_lp:
                c["logprobs"] = {
                    "tokens": [f"token_id:{t}" for t, _ in toks],
                    "token_logprobs": [lp for _, lp in toks],
                    "top_logprobs": [{f"token_id:{t}": lp} for t, lp in toks],
                    "text_offset": [],
                }
            if body.get("return_token_ids"):
                c["token_ids"] = [t for t, _ in toks]
                c["prompt_token_ids"] = prompt if first else None
            return c

        def envelope(c: dict, usage: dict | None = None) -> dict:
            out = {"id": cid, "object": "text_completion", "created": created, "model": cfg.model}
            return {**out, "choices": [c], "usage": usage}

        def usage(n: int) -> dict:
            return {
                "prompt_tokens": len(prompt),
                "completion_tokens": n,
                "total_tokens": len(prompt) + n,
            }

        return await sampled_answer(
            state.sample(prompt, max_tokens, stop_ids, adapter),
            bool(body.get("stream")),
            lambda toks, finish: envelope(choice(toks[-1:], finish, len(toks) == 1)),
            lambda toks, finish: envelope(choice(toks, finish, True), usage(len(toks))),
        )


def add_vllm_generate_route(app: FastAPI, state: StubState) -> None:
    """`POST /inference/v1/generate`, vLLM 0.32's token-in/token-out API (`output_mode`
    "tokens"), with each choice's `weight_versions`."""
    cfg = state.cfg

    @app.post("/inference/v1/generate")
    async def generate(request: Request) -> Any:
        if (full := state.overloaded()) is not None:
            return full
        body = await request.json()
        prompt = body.get("token_ids")
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            return error("stub: token_ids must be a non-empty list of token ids", 400)
        sp = body.get("sampling_params")
        if not isinstance(sp, dict):
            return error("stub: sampling_params is required", 400)
        model = body.get("model")
        adapter = None if model in (None, cfg.model) else model
        if state.salt_of(adapter) is None:
            return error(f"The model `{model}` does not exist.", 404, "NotFoundError")
        max_tokens = int(sp.get("max_tokens") or 16)
        stop_ids = set(sp.get("stop_token_ids") or [])
        want_lp = sp.get("logprobs") is not None
        rid = str(body.get("request_id") or uuid.uuid4().hex)
        sample = state.sample(prompt, max_tokens, stop_ids, adapter)

        def choice(toks: list[Tok], finish: str | None) -> dict[str, Any]:
            c: dict[str, Any] = {
                "index": 0,
                "finish_reason": finish,
                "stop_reason": None,
                "token_ids": [t for t, _ in toks],
                "logprobs": None,
            }
            if want_lp:
                content = [{"token_id": t, "logprob": lp, "top_logprobs": []} for t, lp in toks]
                c["logprobs"] = {"content": content}
            return c

        if body.get("stream"):

            async def events() -> AsyncIterator[str]:
                labels: list[str] = []
                async for tok, lp, finish, label in sample:
                    labels.append(label)
                    c = choice([(tok, lp)], finish)
                    if finish:  # the final chunk covers the whole output
                        c["weight_versions"] = label_spans(labels)
                    yield sse({"request_id": rid, "output_mode": "tokens", "choices": [c]})
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        toks: list[Tok] = []
        labels: list[str] = []
        finish = "length"
        async for tok, lp, fin, label in sample:
            toks.append((tok, lp))
            labels.append(label)
            finish = fin or finish
        c = {**choice(toks, finish), "weight_versions": label_spans(labels)}
        n = len(toks)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n}
        return {
            "request_id": rid,
            "model": cfg.model,
            "output_mode": "tokens",
            "choices": [c],
            "usage": {**usage, "total_tokens": len(prompt) + n},
        }


def add_vllm_chat_route(app: FastAPI, state: StubState) -> None:
    """`POST /v1/chat/completions`, token-agnostic: for proxies that forward chat as chat.

    No template and no tokenizer: the answer is `output_tokens` pseudo-tokens of
    text after the same latencies, so a proxy's chat route can be measured
    against the same backend. rlgate itself templates and sends token ids.
    """
    cfg = state.cfg

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        if (full := state.overloaded()) is not None:
            return full
        body = await request.json()
        messages = body.get("messages")
        if not (isinstance(messages, list) and messages):
            return error("stub: messages must be a non-empty list", 400)
        # a stand-in prompt: one "token" per message, its content's length
        prompt = [len(str(m.get("content") or "")) for m in messages]
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        cid, created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())
        head = {"id": cid, "created": created, "model": cfg.model}
        if body.get("stream"):

            async def events() -> AsyncIterator[str]:
                async for tok, _, finish, _ in state.sample(prompt, max_tokens, set()):
                    delta = {"role": "assistant", "content": text_of(tok)}
                    c = {"index": 0, "delta": delta, "finish_reason": finish}
                    yield sse({**head, "object": "chat.completion.chunk", "choices": [c]})
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        toks = [tok async for tok, _, _, _ in state.sample(prompt, max_tokens, set())]
        message = {"role": "assistant", "content": "".join(text_of(t) for t in toks)}
        n = len(toks)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n}
        return {
            **head,
            "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "finish_reason": "length"}],
            "usage": {**usage, "total_tokens": len(prompt) + n},
        }


def add_vllm_lora_routes(app: FastAPI, state: StubState) -> None:
    """vLLM's runtime LoRA API (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`), with its error answers."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Any:
        body = await request.json()
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return error("Both 'lora_name' and 'lora_path' must be provided.", 400)
        if name in state.adapters and not body.get("load_inplace"):
            return error(f"The lora adapter '{name}' has already been loaded.", 400)
        state.adapters[name] = path
        state.adapter_loads += 1
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Any:
        name = (await request.json()).get("lora_name")
        if state.adapters.pop(name, None) is None:
            return error(f"The lora adapter '{name}' cannot be found.", 404, "NotFoundError")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def add_sglang_routes(app: FastAPI, state: StubState) -> None:
    cfg = state.cfg

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": state.weights_path or cfg.model, "is_generation": True}

    async def pause_body(request: Request) -> dict[str, Any]:
        body = await request.json() if await request.body() else {}
        return {"mode": body.get("mode")}

    add_pause_routes(
        app,
        state,
        "/pause_generation",
        "/continue_generation",
        lambda done: {"message": f"Generation {done} successfully.", "status": "ok"},
        pause_body,
    )

    @app.post("/update_weights_from_disk")
    async def update(request: Request) -> JSONResponse:
        body = await request.json()
        if not body.get("model_path"):
            return JSONResponse({"success": False, "message": "model_path is required"}, 400)
        in_place = state.pause is not None and state.pause["mode"] == "in_place"
        if body.get("flush_cache", True) and in_place and state.in_flight:
            msg = "Failed to flush cache: requests are running (paused in_place)"
            return JSONResponse({"success": False, "message": msg}, 400)
        state.reload(body["model_path"])
        state.weight_version_label = body.get("weight_version")
        msg = "Succeeded to update model weights."
        return JSONResponse({"success": True, "message": msg, "num_paused_requests": 0})

    add_sglang_lora_routes(app, state)
    add_sglang_generate_route(app, state)


def add_sglang_lora_routes(app: FastAPI, state: StubState) -> None:
    """SGLang's LoRA load and unload, answering with every loaded adapter."""

    def lora_answer(success: bool, message: str = "") -> JSONResponse:
        body = {"success": success, "error_message": message, "loaded_adapters": state.adapters}
        return JSONResponse(body, 200 if success else 400)

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> JSONResponse:
        body = await request.json()
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return lora_answer(False, "lora_name and lora_path are required")
        if name in state.adapters:
            return lora_answer(False, f"LoRA adapter {name} is already loaded")
        state.adapters[name] = path
        state.adapter_loads += 1
        return lora_answer(True)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        name = (await request.json()).get("lora_name")
        if state.adapters.pop(name, None) is None:
            return lora_answer(False, f"LoRA adapter {name} is not loaded")
        return lora_answer(True)


def add_sglang_generate_route(app: FastAPI, state: StubState) -> None:
    """`POST /generate` on `input_ids`, with SGLang's `meta_info`."""
    cfg = state.cfg

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        if (full := state.overloaded()) is not None:
            return full
        body = await request.json()
        ids = body.get("input_ids")
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids)):
            return JSONResponse({"error": {"message": "stub: input_ids required"}}, 400)
        adapter = body.get("lora_path")
        if state.salt_of(adapter) is None:
            return error(f"LoRA adapter {body['lora_path']!r} is not loaded", 400)
        sp = body.get("sampling_params") or {}
        max_new = int(sp.get("max_new_tokens") or 128)
        stop_ids = set(sp.get("stop_token_ids") or [])
        rid = body.get("rid") or uuid.uuid4().hex

        def payload(toks: list[Tok], finish: str | None, since: int = 0) -> dict:
            meta: dict[str, Any] = {
                "id": rid,
                "finish_reason": None,
                "prompt_tokens": len(ids),
                "completion_tokens": len(toks),
                "cached_tokens": 0,
                "weight_version": state.weight_version_label or str(state.version),
            }
            if finish == "length":
                meta["finish_reason"] = {"type": "length", "length": len(toks)}
            elif finish == "stop":
                meta["finish_reason"] = {"type": "stop", "matched": toks[-1][0]}
            if body.get("return_logprob"):
                meta["output_token_logprobs"] = [[lp, t, None] for t, lp in toks[since:]]
                start = int(body.get("logprob_start_len", -1))
                span = ids[start:] if start >= 0 else []
                meta["input_token_logprobs"] = [[None, t, None] for t in span]
            text = "".join(text_of(t) for t, _ in toks[since:])
            return {"text": text, "output_ids": [t for t, _ in toks[since:]], "meta_info": meta}

        def chunk(toks: list[Tok], finish: str | None) -> dict:
            # cumulative by default, as SGLang streams; or only the new token
            return payload(toks, finish, len(toks) - 1 if cfg.incremental_streaming_output else 0)

        return await sampled_answer(
            state.sample(ids, max_new, stop_ids, adapter),
            bool(body.get("stream")),
            chunk,
            payload,
        )


def create_app(cfg: StubConfig) -> FastAPI:
    """The stand-in server for `cfg.flavor`."""
    app = FastAPI(title=f"rlgate stub ({cfg.flavor})")
    state = StubState(cfg)
    app.state.stub = state
    add_common_routes(app, state)
    routes = {"vllm": add_vllm_routes, "sglang": add_sglang_routes}
    routes[cfg.flavor](app, state)
    if cfg.api_key:
        expected = f"Bearer {cfg.api_key}".encode()

        @app.middleware("http")
        async def require_key(request: Request, call_next: Any) -> Any:
            given = request.headers.get("authorization", "").encode()
            if request.url.path in OPEN_PATHS or hmac.compare_digest(given, expected):
                return await call_next(request)
            state.refused += 1
            return JSONResponse({"error": {"message": "invalid API key"}}, status_code=401)

    return app


def flavor_of(name: str) -> str:
    """The API to speak for `name`: a flavor, or a registered backend kind's `stub_flavor`."""
    if name in FLAVORS:
        return name
    from inference import registry

    flavor = registry.get(name).stub_flavor
    if flavor is None:
        raise ValueError(f"no stand-in server speaks the API of backend {name!r}")
    return flavor


def launch(
    flavor: str,
    port: int,
    *,
    host: str = "127.0.0.1",
    latency_ms: float = 0.0,
    output_tokens: int = 16,
    extra: Sequence[str] = (),
    log: Path | None = None,
) -> subprocess.Popen:
    """Start the stand-in as a child process (wait for it with `rlgate.stack.wait_healthy`).

    `flavor` is an API flavor or a registered backend kind that names one.
    """
    cmd = [
        sys.executable,
        "-m",
        "inference.stub_server",
        f"--flavor={flavor_of(flavor)}",
        f"--host={host}",
        f"--port={port}",
        f"--latency-ms={latency_ms}",
        f"--output-tokens={output_tokens}",
        *extra,
    ]
    if log is None:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", choices=FLAVORS, default="vllm")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--model", default="stub-model")
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--token-latency-ms", type=float, default=0.0)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--token-base", type=int, default=100)
    parser.add_argument("--version", type=int, default=0)
    parser.add_argument("--incremental-streaming-output", action="store_true")
    parser.add_argument("--max-running", type=int, default=-1)
    parser.add_argument("--no-lora", dest="lora", action="store_false", help="vllm: no LoRA API")
    parser.add_argument("--api-key", default="", help="require 'Authorization: Bearer KEY'")
    args = parser.parse_args(argv)
    import uvicorn

    # every option but host and port is a StubConfig field of the same name
    options = vars(args)
    cfg = StubConfig(**{f.name: options[f.name] for f in fields(StubConfig) if f.name in options})
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    uvicorn.run(create_app(cfg), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
