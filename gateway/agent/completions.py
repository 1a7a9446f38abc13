"""Chat completions: render, generate token ids, store the exact sample (the sampling core)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from core.store.episodes import episode_group
from core.store.lineage import Lineage
from core.store.models import Completion, Episode, Run, stored_version_starts
from core.store.runs import checkpoint_of, list_runs, policy_versions
from gateway.agent.capture import CaptureWriter, split_conflict
from gateway.agent.encoders.chat import chat_completion
from gateway.agent.episodes import (
    VERSION_HEADER,
    EpisodeRef,
    Placement,
    answer_message,
    conversation_hash,
    explicit_ids,
    place,
    sampled_stream,
    with_sampled_answers,
)
from gateway.agent.policies import PolicyRuns
from gateway.control.admission import Admission, run_unavailable
from gateway.control.backends import BackendPool, PinUnsupported, RunServing, ServedWeights
from gateway.errors import APIError, InvalidRequest, Unavailable, backend_failure
from gateway.protocol import ChatCompletion, ChatCompletionRequest
from inference import registry
from inference.backend import BackendError
from inference.reasoning import opens_think, split_reasoning
from inference.tool_parsers import ToolParser, get_parser
from inference.tool_prompt import with_tools
from inference.types import (
    MIN_TEMPERATURE,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    truncate_at_stop,
)
from trainer.config import RunConfig

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
PREWARM_RETRY_S = 60.0  # a run whose servers did not answer is not prepared again sooner


@dataclass(frozen=True)
class Prepared:
    """A chat call ready to sample: where it goes and exactly which ids the model will see."""

    run: Run
    serving: RunServing
    messages: list[dict[str, Any]]
    placement: Placement
    prompt_ids: list[int]
    spliced: bool
    params: SamplingParams
    n: int = 1  # choices to sample, each an episode of the call's group
    tool_parser: ToolParser | None = None  # set when the call offers tools
    one_tool_call: bool = False  # `parallel_tool_calls: false`: keep the first call only
    reasoning: bool = False  # split <think>...</think> into reasoning_content
    think_open: bool = False  # the prompt ends in an open <think>: sampling starts inside it


class ChatService:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        pool: BackendPool,
        capture: CaptureWriter | None = None,
        admission: Admission | None = None,
        reads: async_sessionmaker[AsyncSession] | None = None,
        policies: PolicyRuns | None = None,
    ) -> None:
        """`reads`: sessions for the placement's reads (`Lineage`), by default `sessions`.
        `policies`: the runs of each run's policies, whose turns share episodes."""
        self.sessions = sessions
        self.pool = pool
        self.policies = policies or PolicyRuns(sessions)
        self.admission = admission or Admission(sessions, pool.serving_version)
        # Without a started writer (no app lifespan) each store is its own transaction.
        self.capture = capture or CaptureWriter(sessions)
        self.lineage = Lineage(reads or sessions)
        self._checkpoints: dict[tuple[str, int], str] = {}
        self._prewarm_failed: dict[str, float] = {}  # run -> when preparing it last failed
        # Run (as the key cache hands it out) -> (its config dict, that dict validated)
        self._configs: weakref.WeakKeyDictionary[Run, tuple[dict, RunConfig]] = (
            weakref.WeakKeyDictionary()
        )

    def config(self, run: Run) -> RunConfig:
        """`run.config` validated, once per Run object and config dict.

        A request's run comes from the agent-key cache (`gateway/middleware/auth_cache.py`), the
        same object until that entry is reloaded; validating its config on every call was
        2 % of a call's CPU.
        """
        kept = self._configs.get(run)
        if kept is not None and kept[0] is run.config:
            return kept[1]
        cfg = RunConfig.model_validate(run.config)
        self._configs[run] = (run.config, cfg)
        return cfg

    async def serving(self, run: Run, ref: EpisodeRef | None = None) -> RunServing:
        """The run's serving; for an evaluation call that pins another version than the one
        it serves now (`EpisodeRef.version`), a serving of that version (`pinned`).

        A pin is compared with the version the serving holds, not with `run.current_version`:
        the run as the key cache hands it out may lag a swap the swap loop has made. A pin
        of the version being served is the run's own serving, marked to start on that
        version (`RunServing.start_on`): a swap that lands before the backend admits the
        call makes it a retryable 409 `version_moved` (its retry finds the version pinned
        elsewhere or not at all), never an answer of another version. A keep-mode swap
        after it started makes it span two versions, and its figures are reported apart.
        """
        current = await self._current(run)
        if ref is None or ref.version is None:
            return current
        if ref.version == current.backend.version:
            return dataclasses.replace(current, start_on=ref.version)
        return await self.pinned(run, ref.version)

    async def _current(self, run: Run) -> RunServing:
        """The run's own serving, loaded on its first call."""
        key = (run.id, run.current_version)
        ckpt = self._checkpoints.get(key)
        if ckpt is None:
            async with self.sessions() as s:
                ckpt = await checkpoint_of(s, run.id, run.current_version)
            if ckpt is not None:
                # A version's checkpoint never changes once written (a rollback makes a new
                # version): one query per version, not one per request.
                if len(self._checkpoints) > 4096:
                    self._checkpoints.clear()
                self._checkpoints[key] = ckpt
        try:
            weights = _weights(run, run.current_version, Path(ckpt) if ckpt else None)
            return await self.pool.get(run.id, weights)
        except (OSError, ValueError) as exc:
            logger.exception("could not load the model of run %s", run.id)
            raise Unavailable(f"the model of run {run.id} could not be loaded") from exc

    async def pinned(self, run: Run, version: int) -> RunServing:
        """A kept older `version` of the run, served beside the current one; a version that
        does not exist or was pruned (`keep_checkpoints`) is a 400 naming those kept."""
        async with self.sessions() as s:
            versions = await policy_versions(s, run.id)
        paths = {pv.version: Path(pv.checkpoint_path) for pv in versions}
        kept = [v for v in sorted(paths) if v == 0 or paths[v].is_dir()]
        if version not in kept:  # committed versions only: a step writes its row on commit
            raise InvalidRequest(
                f"{VERSION_HEADER}: version {version} of run {run.name!r} is not kept; "
                f"kept versions: {', '.join(map(str, kept)) or 'none'}",
                code="version_not_kept",
            )
        try:
            weights = _weights(run, version, paths[version] if version > 0 else None)
            return await self.pool.pinned(run.id, weights)
        except PinUnsupported as exc:
            raise InvalidRequest(
                f"{VERSION_HEADER}: {exc}; pins are served for LoRA runs and on the local backend",
                code="version_pin_unsupported",
            ) from exc
        except OSError as exc:
            logger.exception("could not load version %d of run %s", version, run.id)
            raise Unavailable(f"version {version} of run {run.id} could not be loaded") from exc

    async def prewarm(self) -> None:
        """Load what serving each active run on inference servers needs (its tokenizer, chat
        template and server clients) before its first call asks for it.

        A gateway process otherwise loads it inside its first call of each run, about two
        seconds that its first callers wait; with `--workers N`, in every process, and for
        a run created after the processes started (one process serves the admin call that
        creates it; the others hear of it at its first call). Called at start and then
        every few seconds (`gateway.app`); a loaded run costs nothing here. Runs sampled in
        this process (`local`) are left to their first call: each is a whole model in
        memory. A run that failed to load is tried again after `PREWARM_RETRY_S`.
        """
        async with self.sessions() as s:
            runs = await list_runs(s)
        now = time.monotonic()
        for run in runs:
            if run.status != "active" or not registry.get(run.backend).remote:
                continue
            if now - self._prewarm_failed.get(run.id, float("-inf")) < PREWARM_RETRY_S:
                continue
            try:
                await self.serving(run)
            except Exception:  # its first call reports what is wrong, as without this
                self._prewarm_failed[run.id] = now
                logger.warning("could not prepare run %s before its first call", run.id)

    async def prepare(
        self, run: Run, req: ChatCompletionRequest, ref: EpisodeRef, *, think: bool = False
    ) -> Prepared:
        """Everything before sampling: ids, placement, the token-exact prompt, sampling params.

        Every client error is raised here, before a stream could have started. `think`
        splits reasoning out even where the run does not parse it (a Messages call that
        enables `thinking`).
        """
        explicit_ids(ref, req.metadata)  # validate ids before any work
        check_supported(req)
        try:
            messages = [m.normalized() for m in req.messages]
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="messages") from exc
        cfg = self.config(run)
        serving = await self.serving(run, ref)
        placement = await self.place(run, cfg, ref, req.metadata, messages)
        prompt_ids, spliced = await self.render(serving, req, messages, placement)
        template = serving.template
        params = sampling_params(
            req,
            n_prompt=len(prompt_ids),
            max_new=req.max_new_tokens(DEFAULT_MAX_TOKENS),
            max_context=serving.max_context,
            top_k=req.top_k,
            stop_token_ids=template.stop_token_ids,
            stop=req.stop_strings(),
            param="messages",
        )
        parser = get_parser(cfg.tool_parser) if req.tools_active() else None
        reasoning = think or cfg.reasoning_parser == "think"
        # The last few ids are enough to see whether the generation prompt opened <think>.
        think_open = reasoning and opens_think(template.stream_text(prompt_ids[-16:]))
        await self.admit(run, cfg, placement, req.n or 1)
        return Prepared(
            run,
            serving,
            messages,
            placement,
            prompt_ids,
            spliced,
            params,
            n=req.n or 1,
            tool_parser=parser,
            one_tool_call=req.parallel_tool_calls is False,
            reasoning=reasoning,
            think_open=think_open,
        )

    async def render(
        self,
        serving: RunServing,
        req: ChatCompletionRequest,
        messages: list[dict[str, Any]],
        placement: Placement,
    ) -> tuple[list[int], bool]:
        """The prompt's token ids, and whether they continue the parent's sampled ids."""
        chain = await self.lineage.ancestry(placement.parent)
        template = serving.template
        # Our own earlier answers are rendered as the text that was sampled (tool calls
        # included), not rebuilt from the structured message the agent echoed; the splice
        # keeps their sampled ids (`sampled_stream`), for chat and Responses alike.
        to_render = with_sampled_answers(messages, chain, template.decode)
        to_render, native_tools = with_tools(
            to_render, req.tool_dicts(), req.tool_choice, template.native_tools
        )
        try:
            if placement.parent is not None:
                stream, answers = sampled_stream(chain)
                return await asyncio.to_thread(
                    template.continue_from, stream, to_render, native_tools, answers
                )
            cached = template.lookup(to_render, native_tools)
            if cached is not None:
                return cached, False
            return await asyncio.to_thread(template.render, to_render, native_tools), False
        except Exception as exc:  # a template can raise on roles or shapes it does not know
            raise InvalidRequest(
                f"messages could not be rendered: {exc}", param="messages"
            ) from exc

    async def place(
        self,
        run: Run,
        cfg: RunConfig,
        ref: EpisodeRef,
        metadata: dict[str, str] | None,
        messages: list[dict[str, Any]],
    ) -> Placement:
        """The call's episode (`gateway.agent.episodes.place`).

        Nothing crosses the training/evaluation split: prefix matching looks in the call's
        own split (`EVAL_SPACE`), and the store refuses a completion in an episode of the
        other one (`completions.held_out`), a 409 at the commit. An evaluation call that
        names a training episode is refused here already, before it samples (one read, on
        a path that is not the training hot path); a training call is not read for it.
        """
        family = await self.policies.family(run) if run.parent_id is not None else None
        placement = await place(
            self.lineage, run.id, ref, metadata, messages, cfg.prefix_match_window_s, family
        )
        if family is not None and placement.link != "new":
            placement = await self._policy_placement(run, placement, family)
        if ref.evaluation and placement.parent is None and placement.link != "new":
            async with self.sessions() as s:
                stored = await s.get(Episode, (run.id, placement.episode_id))
            if stored is not None and not stored.held_out:
                raise split_conflict(placement.episode_id, evaluation=True)
        return placement

    async def _policy_placement(
        self, run: Run, placement: Placement, family: list[str]
    ) -> Placement:
        """A policy's first turn in an episode another policy of its run began: joined, as
        a later turn (admitted once, when the episode began), and in that episode's group
        unless the call names one, so each policy's turns of one task share a group."""
        async with self.sessions() as s:
            if await s.get(Episode, (run.id, placement.episode_id)) is not None:
                return placement  # this policy's episode exists: its group stays
            group = await episode_group(s, family, placement.episode_id)
        if group is None:
            return placement  # a new episode for every policy
        return dataclasses.replace(placement, group_id=placement.group_id or group, joined=True)

    async def admit(self, run: Run, cfg: RunConfig, placement: Placement, n: int = 1) -> None:
        """The last step of every endpoint's `prepare`, after every client error: a paused or
        stopped run answers 429, a call that could not be stored answers 503 (a stream
        before its first byte), and a new conversation waits here while the trainer cannot
        absorb it (`gateway.control.admission`). An evaluation call never waits: it is
        never trained on, so the trainer's backlog is none of its business."""
        if run.status != "active":
            raise run_unavailable(run.id, run.status)
        await self.capture.check()  # the store lost its last batch: a 503 before sampling
        if not placement.evaluation:
            await self.admission.admit(run, cfg, placement, n)

    async def create(self, run: Run, req: ChatCompletionRequest, ref: EpisodeRef) -> ChatCompletion:
        prep = await self.prepare(run, req, ref)
        base_id = new_chat_id()
        rows, group_id = await self.sample(prep, base_id)
        return chat_completion(req, prep, base_id, group_id, rows)

    async def sample(self, prep: Prepared, base_id: str) -> tuple[list[Completion], str | None]:
        """Sample the call's `n` choices and store them: (the stored rows, the group of n > 1).

        With n = 1 the completion's id is `base_id`; choice i of n > 1 is `base_id-i`.
        """
        serving, params, prompt_ids, run = prep.serving, prep.params, prep.prompt_ids, prep.run
        n = prep.n
        try:
            results = await asyncio.gather(
                *(
                    serving.backend.generate(
                        GenerateRequest(
                            prompt_ids,
                            _nth_seed(params, i),
                            prep.placement.episode_id,
                            version=serving.start_on,
                        )
                    )
                    for i in range(n)
                )
            )
        except BackendError as exc:
            logger.warning("backend failed for run %s: %s", run.id, exc)
            raise backend_failure(exc) from exc
        # n > 1: each choice is an episode of its own, and together they form one group.
        group_id = (
            prep.placement.group_id if n == 1 else (prep.placement.group_id or f"n-{base_id}")
        )
        rows = [
            self.completion_row(
                prep, base_id if n == 1 else f"{base_id}-{i}", i if n > 1 else None, r
            )
            for i, r in enumerate(results)
        ]
        await self.store(rows, group_id, evaluation=prep.placement.evaluation)
        return rows, group_id if n > 1 else None

    @staticmethod
    def completion_row(
        prep: Prepared, completion_id: str, choice: int | None, result: GenerateResult
    ) -> Completion:
        """The stored record of one sample; `choice` is set for the choices of n > 1."""
        placement, parent = prep.placement, prep.placement.parent
        episode_id = placement.episode_id
        if choice is not None:
            episode_id = f"{placement.episode_id[:95]}.n{choice}"
        text = truncate_at_stop(
            prep.serving.template.decode(result.output_token_ids), prep.params.stop
        )
        calls: list[dict[str, Any]] = []
        reasoning = None
        if prep.reasoning:
            reasoning, text = split_reasoning(text, prep.think_open)
        if prep.tool_parser is not None:
            text, parsed = prep.tool_parser(text)
            if prep.one_tool_call:
                parsed = parsed[:1]
            calls = [c.to_openai() for c in parsed]
        row = Completion(
            id=completion_id,
            run_id=prep.run.id,
            episode_id=episode_id,
            parent_id=parent.id if parent else None,
            messages=prep.messages,
            prompt_token_ids=prep.prompt_ids,
            output_token_ids=result.output_token_ids,
            output_logprobs=result.output_logprobs,
            content=text,
            finish_reason=result.finish_reason,
            temperature=prep.params.temperature,
            policy_version=result.policy_version,
            version_starts=stored_version_starts(result.version_starts),
            tool_calls=calls or None,
            reasoning_content=reasoning,
            conv_hash=conversation_hash(
                [*prep.messages, answer_message(text, calls)], evaluation=placement.evaluation
            ),
            prompt_hash=conversation_hash(prep.messages, evaluation=placement.evaluation),
            spliced=prep.spliced,
            drift=parent is not None and not prep.spliced,
            link=placement.link,
            held_out=placement.evaluation,
        )
        if row.drift:
            logger.info(
                "template drift in run %s after %s: new sequence", prep.run.id, row.parent_id
            )
        return row

    async def store(
        self, rows: list[Completion], group_id: str | None, *, evaluation: bool = False
    ) -> None:
        """Commit the completions and, if new, their episodes before the answer goes out.

        Group commit (`CaptureWriter`): batched with concurrent requests' rows, and
        awaited, so an answered completion is always stored; 503 if the database is down.
        `evaluation`: the episodes they open are held out (`EpisodeStatus.EVAL`).
        """
        await self.capture.submit(rows, group_id, evaluation=evaluation)


class SamplingFields(Protocol):
    """The sampling fields a chat or text completion request has in common."""

    temperature: float | None
    top_p: float | None
    seed: int | None


def sampling_params(
    req: SamplingFields,
    *,
    n_prompt: int,
    max_new: int,
    max_context: int,
    top_k: int | None = None,
    stop_token_ids: tuple[int, ...],
    stop: tuple[str, ...],
    param: str,
) -> SamplingParams:
    """`req`'s validated sampling parameters; a client error is an InvalidRequest naming
    `param`."""
    if n_prompt + max_new > max_context:
        raise InvalidRequest(
            f"prompt ({n_prompt} tokens) plus max_tokens ({max_new}) exceeds the "
            f"model's context of {max_context} tokens",
            param=param,
            code="context_length_exceeded",
        )
    temp = 1.0 if req.temperature is None else req.temperature
    if temp < MIN_TEMPERATURE:
        temp = 0.0  # greedy: a vanishing temperature is argmax anyway
    try:
        return SamplingParams(
            max_tokens=max_new,
            temperature=temp,
            top_p=req.top_p or 1.0,
            top_k=max(top_k or 0, 0),
            seed=req.seed,
            stop_token_ids=stop_token_ids,
            stop=stop,
        )
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc


def check_supported(req: ChatCompletionRequest) -> None:
    """Refuse what the backends cannot sample exactly, before any work."""
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(req, name):
            raise InvalidRequest(
                f"{name} is not supported by the local backend: penalised sampling would "
                "make the reported logprobs differ from the trainer's",
                param=name,
            )
    fmt = (req.response_format or {}).get("type", "text")
    if fmt != "text":
        raise InvalidRequest(
            f"response_format {fmt!r} needs a backend with guided decoding (vLLM); "
            "the local backend has none",
            param="response_format",
        )


def translated_request(
    body: dict[str, Any], names: dict[str, str], messages: dict[str, str] | None = None
) -> ChatCompletionRequest:
    """The chat request another API family's call becomes (`None` values left out).

    A field the chat request refuses is named as that family names it (`names`: chat
    field to theirs); `messages` words the error for some of their fields.
    """
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None}
        )
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err.get("loc", ())]
        param = names.get(loc[0], loc[0]) if loc else None
        msg = (messages or {}).get(param or "", err.get("msg"))
        raise InvalidRequest(f"{param}: {msg}", param=param, code="invalid_value") from exc


@contextlib.contextmanager
def params_renamed(names: dict[str, str]) -> Iterator[None]:
    """Errors the chat service raises name chat fields; another family's caller knows
    them by that family's names (`names`: chat field to theirs)."""
    try:
        yield
    except APIError as exc:
        exc.param = names.get(exc.param or "", exc.param)
        raise


def _weights(run: Run, version: int, ckpt: Path | None) -> ServedWeights:
    """`version` of the run's model, read from `ckpt` (None: the model as created)."""
    lora = run.config.get("lora_rank") is not None
    return ServedWeights(Path(run.model_path), run.backend, version, ckpt, lora=lora)


def new_chat_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex


def _nth_seed(params: SamplingParams, i: int) -> SamplingParams:
    """Choice i of a seeded n > 1 request samples with seed + i (distinct, reproducible)."""
    if i == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + i) % 2**63)
