"""A completion sampled across hot swaps: its `version_starts` is answered, stored, shown
and exported, on every agent API, streamed and not, on SQLite and on PostgreSQL.

Two backends. The last tests (kind "local-held") take a REAL keep-mode swap: the real
local backend, held at a token while the test commits a new version, which the gateway's
own swap loop swaps in; the answer's versions are the backend's own marks. The rest use
a TEST backend defined here (kind "split-versions", registered in this
process only): the real local backend on the tiny model, whose results are re-marked as
if two keep-mode swaps had happened while they were sampled (version v from token 0, v+1
from token 1, v+2 from token 3; `inference.types.result_with_marks` drops what an output
too short never reached). Its tokens and logprobs are the model's own; only the version
marks are made up, because what is under test is everything after the backend: the
capture (`gateway.agent`), the answers' encoders, the store, the admin views, the
dashboard's episode page and the export. The gateway is the real app under uvicorn on
loopback, in this process so that it sees the registration; the agents are the real
openai and anthropic clients.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import json
import re
import sqlite3
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import psycopg
import pyarrow.parquet as pq
import pytest

from gateway.app import create_app
from inference import registry
from inference.backend import TokenStream
from inference.local import LocalBackend
from inference.registry import BackendKind
from inference.types import GenerateRequest, GenerateResult, result_with_marks
from tests.conftest import ADMIN_KEY, gateway_settings, serving_in_thread

pytestmark = pytest.mark.integration

PG_URL = "postgresql://postgres@127.0.0.1:5432/test"
QUESTION = [{"role": "user", "content": "what is one plus two?"}]
MAX_TOKENS = 8
SWAPS_AT = (1, 3)  # the token indexes where the made-up keep-mode swaps took effect


def remarked(result: GenerateResult) -> GenerateResult:
    """`result` as if a keep-mode swap had taken effect before each index of `SWAPS_AT`."""
    v = result.policy_version
    marks = [(0, v), *((i, v + 1 + k) for k, i in enumerate(SWAPS_AT))]
    return result_with_marks(
        result.output_token_ids, result.output_logprobs, result.finish_reason, marks
    )


class _RemarkedStream:
    def __init__(self, inner: TokenStream, owner: SplitVersionBackend) -> None:
        self.inner, self.owner = inner, owner

    def tokens(self) -> AsyncIterator[tuple[int, float]]:
        return self.inner.tokens()

    def cancel(self) -> None:
        self.inner.cancel()

    async def result(self) -> GenerateResult:
        return self.owner.produced(await self.inner.result())


class SplitVersionBackend:
    """The local backend whose results say they spanned versions (see the module doc);
    with `split` off, results pass through unchanged (one version)."""

    split = True
    last: GenerateResult | None = None  # the latest result handed to the gateway

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.inner = LocalBackend(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def produced(self, result: GenerateResult) -> GenerateResult:
        out = remarked(result) if SplitVersionBackend.split else result
        SplitVersionBackend.last = out
        return out

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return self.produced(await self.inner.generate(request))

    def start_stream(self, request: GenerateRequest) -> _RemarkedStream:
        return _RemarkedStream(self.inner.start_stream(request), self)


def expected() -> list[list[int]] | None:
    """What the gateway was handed last, as the APIs and the store carry it."""
    result = SplitVersionBackend.last
    assert result is not None
    return [list(p) for p in result.version_starts] or None


def spanning() -> list[list[int]]:
    """`expected()`, which must span versions (the tiny model sampled past `SWAPS_AT[0]`)."""
    starts = expected()
    assert starts is not None and len(starts) >= 2, SplitVersionBackend.last
    assert starts[0] == [0, SplitVersionBackend.last.policy_version]
    return starts


@dataclass
class Stack:
    url: str
    run: dict
    admin: httpx.Client
    stored: Callable[[str], str | None]  # completion id -> its version_starts as JSON text
    made: dict[str, list[list[int]] | None]  # completion id -> the version_starts it got

    def openai(self, episode: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/episodes/{episode}/v1",
            api_key=self.run["api_key"],
            max_retries=0,
        )

    def anthropic(self, episode: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(
            base_url=f"{self.url}/episodes/{episode}", api_key=self.run["api_key"], max_retries=0
        )

    def check_stored(self, completion_id: str, want: list[list[int]] | None) -> None:
        value = self.stored(completion_id)  # JSON text, None only for SQL NULL
        assert (None if value is None else json.loads(value)) == want, completion_id
        assert (value is None) == (want is None), "one version is SQL NULL, not JSON null"
        self.made[completion_id] = want


@contextlib.contextmanager
def _sqlite(tmp: Path, model_cache: Path) -> Iterator[tuple[Any, Callable[[str], Any]]]:
    settings = gateway_settings(tmp / "data", model_cache)

    def stored(completion_id: str) -> Any:
        with contextlib.closing(
            sqlite3.connect(f"file:{settings.data_dir / 'rlgate.db'}?mode=ro", uri=True)
        ) as conn:
            (value,) = conn.execute(
                "SELECT version_starts FROM completions WHERE id = ?", (completion_id,)
            ).fetchone()
        return value

    yield settings, stored


@contextlib.contextmanager
def _postgres(tmp: Path, model_cache: Path) -> Iterator[tuple[Any, Callable[[str], Any]]]:
    try:
        admin = psycopg.connect(PG_URL, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL must run at {PG_URL} for this test: {exc}")
    schema = "rlgate_vs_" + uuid.uuid4().hex[:10]
    admin.execute(f'CREATE SCHEMA "{schema}"')
    settings = gateway_settings(tmp / "data", model_cache, database_url=PG_URL)

    def stored(completion_id: str) -> Any:
        value, is_null = admin.execute(
            f"SELECT version_starts, version_starts IS NULL"
            f' FROM "{schema}".completions WHERE id = %s',
            (completion_id,),
        ).fetchone()
        return None if is_null else json.dumps(value)  # JSON null would read as "null"

    try:
        with pytest.MonkeyPatch.context() as mp:  # libpq reads it at every connect
            mp.setenv("PGOPTIONS", f"-c search_path={schema}")
            yield settings, stored
    finally:
        admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        admin.close()


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def stack(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    model_cache_dir: Path,
    tiny_model_dir: Path,
) -> Iterator[Stack]:
    registry.register(
        BackendKind(
            "split-versions",
            label="local, re-marked as spanning versions (test)",
            load=SplitVersionBackend,
        )
    )
    store = _sqlite if request.param == "sqlite" else _postgres
    try:
        with (
            store(tmp_path_factory.mktemp(request.param), model_cache_dir) as (settings, stored),
            serving_in_thread(create_app(settings)) as url,
            httpx.Client(
                base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=120
            ) as admin,
        ):
            body = {"name": "vs", "model": "tiny", "backend": "split-versions"}
            created = admin.post("/admin/v1/runs", json=body)
            assert created.status_code == 201, created.text
            yield Stack(url, created.json(), admin, stored, {})
    finally:
        registry.unregister("split-versions")
        SplitVersionBackend.split = True


@pytest.fixture
def one_version() -> Iterator[None]:
    SplitVersionBackend.split = False
    try:
        yield
    finally:
        SplitVersionBackend.split = True


def _extra(obj: Any, name: str) -> Any:
    """An rlgate extension field of an SDK object (kept as an extra attribute)."""
    return (obj.model_extra or {}).get(name)


# --- answers ------------------------------------------------------------------------------


def test_chat_answer_carries_version_starts(stack: Stack) -> None:
    answer = stack.openai("chat").chat.completions.create(
        model="vs", messages=QUESTION, max_tokens=MAX_TOKENS, temperature=1.0, seed=1
    )
    starts = spanning()
    assert _extra(answer, "version_starts") == starts
    assert _extra(answer, "policy_version") == starts[0][1]  # the oldest, the first token's
    assert _extra(answer.choices[0], "version_starts") == starts
    stack.check_stored(answer.id, starts)


def test_chat_stream_puts_version_starts_on_its_finish_and_usage_chunks(stack: Stack) -> None:
    chunks = list(
        stack.openai("chat-stream").chat.completions.create(
            model="vs",
            messages=QUESTION,
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    starts = spanning()
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = [c for c in chunks if not c.choices]
    assert len(finish) == 1 and len(usage) == 1
    assert _extra(finish[0], "version_starts") == starts
    assert _extra(usage[0], "version_starts") == starts
    # known only at the end: no earlier chunk carries it
    assert all("version_starts" not in (c.model_extra or {}) for c in chunks[:-2])
    stack.check_stored(chunks[0].id, starts)


def test_text_completion_carries_version_starts(stack: Stack) -> None:
    client = stack.openai("text")
    answer = client.completions.create(model="vs", prompt="one plus two is", max_tokens=MAX_TOKENS)
    starts = spanning()
    assert _extra(answer, "version_starts") == starts
    stack.check_stored(answer.id, starts)

    chunks = list(
        stack.openai("text-stream").completions.create(
            model="vs", prompt="one plus two is", max_tokens=MAX_TOKENS, stream=True
        )
    )
    starts = spanning()
    assert chunks[-1].choices[0].finish_reason is not None
    assert _extra(chunks[-1], "version_starts") == starts
    assert all("version_starts" not in (c.model_extra or {}) for c in chunks[:-1])
    stack.check_stored(chunks[0].id, starts)


def test_responses_carry_version_starts(stack: Stack) -> None:
    resp = stack.openai("responses").responses.create(
        model="vs", input="what is one plus two?", max_output_tokens=MAX_TOKENS
    )
    starts = spanning()
    assert _extra(resp, "version_starts") == starts
    stack.check_stored(_extra(resp, "completion_id"), starts)

    events = list(
        stack.openai("responses-stream").responses.create(
            model="vs", input="what is one plus two?", max_output_tokens=MAX_TOKENS, stream=True
        )
    )
    starts = spanning()
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    assert _extra(last.response, "version_starts") == starts
    created = next(e for e in events if e.type == "response.created")
    assert _extra(created.response, "version_starts") is None  # not known yet
    stack.check_stored(_extra(last.response, "completion_id"), starts)


def test_messages_carry_version_starts(stack: Stack) -> None:
    msg = stack.anthropic("messages").messages.create(
        model="vs", max_tokens=MAX_TOKENS, messages=QUESTION
    )
    starts = spanning()
    assert _extra(msg, "version_starts") == starts
    assert _extra(msg, "policy_version") == starts[0][1]
    stack.check_stored(msg.id, starts)

    with stack.anthropic("messages-stream").messages.stream(
        model="vs", max_tokens=MAX_TOKENS, messages=QUESTION
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = spanning()
    [delta] = [e for e in events if e.type == "message_delta"]
    assert _extra(delta, "version_starts") == starts
    assert _extra(delta, "policy_version") == starts[0][1]
    stack.check_stored(final.id, starts)


def test_one_version_answers_null_and_stores_null(stack: Stack, one_version: None) -> None:
    client = stack.openai("one-version")
    answer = client.chat.completions.create(model="vs", messages=QUESTION, max_tokens=MAX_TOKENS)
    assert expected() is None
    assert _extra(answer, "version_starts") is None
    assert isinstance(_extra(answer, "policy_version"), int)
    stack.check_stored(answer.id, None)

    chunks = list(
        client.chat.completions.create(
            model="vs", messages=QUESTION, max_tokens=MAX_TOKENS, stream=True
        )
    )
    assert all("version_starts" not in (c.model_extra or {}) for c in chunks)
    stack.check_stored(chunks[0].id, None)


# --- admin views, dashboard, export ---------------------------------------------------------


def _completions_made(stack: Stack) -> dict[str, list[list[int]] | None]:
    assert len(stack.made) >= 8, "the answer tests above run first and record what they made"
    return stack.made


def test_admin_views_show_each_tokens_version(stack: Stack) -> None:
    made = _completions_made(stack)
    run_id = stack.run["run_id"]
    page = stack.admin.get(f"/admin/v1/runs/{run_id}/episodes", params={"limit": 100}).json()
    seen = 0
    for summary in page["data"]:
        detail = stack.admin.get(f"/admin/v1/runs/{run_id}/episodes/{summary['episode_id']}")
        assert detail.status_code == 200, detail.text
        episode_versions: set[int] = set()
        for c in detail.json()["completions"]:
            want = made[c["completion_id"]]
            spans = want or [[0, c["policy_version"]]]
            assert c["version_starts"] == want
            assert c["policy_version"] == spans[0][1]
            assert c["versions"] == [v for _, v in spans]
            per_token = [t["version"] for t in c["output_tokens"]]
            assert len(per_token) == len(c["output_token_ids"])
            for k, (start, version) in enumerate(spans):
                end = spans[k + 1][0] if k + 1 < len(spans) else len(per_token)
                assert per_token[start:end] == [version] * (end - start)
            assert all(t["version"] is None for t in c["prompt_tokens"])
            episode_versions.update(v for _, v in spans)
            seen += 1
        assert summary["versions"] == sorted(episode_versions)
        assert detail.json()["versions"] == sorted(episode_versions)
    assert seen == len(made)


def _dashboard(url: str) -> httpx.Client:
    http = httpx.Client(base_url=url, timeout=60, follow_redirects=False)
    form = http.get("/dashboard/login").text
    token = re.search(r'name="csrf_token" value="([^"]+)"', form)
    assert token is not None
    r = http.post("/dashboard/login", data={"csrf_token": token.group(1), "admin_key": ADMIN_KEY})
    assert r.status_code == 303, r.text
    return http


def test_dashboard_episode_page_marks_where_each_version_began(stack: Stack) -> None:
    made = _completions_made(stack)
    run_id = stack.run["run_id"]
    with contextlib.closing(_dashboard(stack.url)) as http:
        html = http.get(f"/dashboard/runs/{run_id}/episodes/chat").text
        one = http.get(f"/dashboard/runs/{run_id}/episodes/one-version").text
    [turn] = stack.admin.get(f"/admin/v1/runs/{run_id}/episodes/chat").json()["completions"]
    starts = made[turn["completion_id"]]
    assert starts is not None
    marks = [int(v) for v in re.findall(r'class="vmark ver-\d" data-version="(\d+)"', html)]
    assert marks == [v for _, v in starts[1:]]  # one mark per later version, in order
    heading = " → ".join(f"v{v}" for _, v in starts)
    assert heading in html
    versions = [
        int(v) for v in re.findall(r'class="tok [a-z]+ ver-\d" [^>]*data-version="(\d+)"', html)
    ]
    assert versions and versions == sorted(versions) and set(versions) == {v for _, v in starts}
    # one version: no mark, no version colours (the legend's sample mark aside)
    assert not re.findall(r'class="vmark ver-\d" data-version', one)
    assert not re.findall(r'class="tok [a-z]+ ver-\d"', one)
    assert re.findall(r'class="tok [a-z]+" [^>]*data-version="\d+"', one)


def test_export_jsonl_and_parquet_carry_version_starts(stack: Stack) -> None:
    made = _completions_made(stack)
    run_id = stack.run["run_id"]
    jsonl = stack.admin.get(f"/admin/v1/runs/{run_id}/export", params={"format": "jsonl"})
    assert jsonl.status_code == 200, jsonl.text
    from_jsonl = {
        c["completion_id"]: c["version_starts"]
        for line in jsonl.text.splitlines()
        for c in json.loads(line)["completions"]
    }
    assert from_jsonl == made
    parquet = stack.admin.get(f"/admin/v1/runs/{run_id}/export", params={"format": "parquet"})
    assert parquet.status_code == 200, parquet.text
    table = pq.read_table(io.BytesIO(parquet.content))
    assert str(table.schema.field("completions").type.value_type.field("version_starts").type) == (
        "list<element: list<element: int64>>"
    )
    from_parquet = {
        c["completion_id"]: c["version_starts"]
        for record in table.to_pylist()
        for c in record["completions"]
    }
    assert from_parquet == made
    assert any(v is None for v in made.values()) and any(v for v in made.values())


# --- a real keep-mode swap in the real local backend ---------------------------------------
#
# Kind "local-held" is the real local backend, plus two test hooks: `arm()` holds its next
# generation in the decode step that samples token `HELD_AT` (no sleeps), and
# `handed` says when a swap reached its worker. While a call is held, the test commits a new
# version in the store as a train step would (a `policy_versions` row, `current_version`);
# the gateway's own swap loop then swaps it in with the run's policy (keep), and the call is
# released: it goes on with the new version from token HELD_AT + 1.

HELD_AT = 3


class HeldLocalBackend(LocalBackend):
    """The local backend with the hold and the hand-over signal described above."""

    current: HeldLocalBackend | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.held, self.release, self.handed = (
            threading.Event(),
            threading.Event(),
            threading.Event(),
        )
        self._steps = -1  # decode steps of the armed generation; -1: none armed
        HeldLocalBackend.current = self

    def arm(self) -> None:
        for event in (self.held, self.release, self.handed):
            event.clear()
        self._steps = 0

    def _decode_step(self, batch: Any) -> None:
        """Hold the decode step that samples token HELD_AT of the armed generation."""
        if self._steps >= 0:
            self._steps += 1
            if self._steps == HELD_AT:
                self._steps = -1
                self.held.set()
                self.release.wait(60)
        super()._decode_step(batch)

    def _defer_to_next_step(self, swap: Any) -> Any:
        future = super()._defer_to_next_step(swap)
        self.handed.set()
        return future


@dataclass
class KeepStack:
    stack: Stack
    db: Path
    checkpoint: Path  # the weights each new version loads (the tiny model's own)

    def commit_version(self) -> int:
        """Commit version current + 1 as a train step would; returns it."""
        run_id = self.stack.run["run_id"]
        with contextlib.closing(sqlite3.connect(self.db, timeout=30)) as conn, conn:
            (current,) = conn.execute(
                "SELECT current_version FROM runs WHERE id = ?", (run_id,)
            ).fetchone()
            conn.execute(
                "INSERT INTO policy_versions (run_id, version, checkpoint_path, created_at)"
                " VALUES (?, ?, ?, CURRENT_TIMESTAMP)",
                (run_id, current + 1, str(self.checkpoint)),
            )
            conn.execute("UPDATE runs SET current_version = ? WHERE id = ?", (current + 1, run_id))
        return int(current) + 1

    def across_a_swap(self, call: Callable[[], Any]) -> tuple[Any, int]:
        """`call`'s answer, sampled across a keep-mode swap to a new version; that version."""
        backend = HeldLocalBackend.current
        assert backend is not None, "the run's backend is loaded by the fixture's first call"
        backend.arm()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(call)
            try:
                while not backend.held.wait(0.1) and not answer.done():
                    pass
                assert backend.held.is_set(), f"it ended before its held token: {answer.result()}"
                version = self.commit_version()
                assert backend.handed.wait(60), "the gateway never swapped the new version in"
            finally:
                backend.release.set()
            return answer.result(timeout=120), version


@pytest.fixture(scope="module")
def keep(
    tmp_path_factory: pytest.TempPathFactory, model_cache_dir: Path, tiny_model_dir: Path
) -> Iterator[KeepStack]:
    registry.register(
        BackendKind("local-held", label="local, held at a token (test)", load=HeldLocalBackend)
    )
    settings = gateway_settings(tmp_path_factory.mktemp("keep") / "data", model_cache_dir)
    try:
        with (
            serving_in_thread(create_app(settings)) as url,
            httpx.Client(
                base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=120
            ) as admin,
        ):
            body = {"name": "keep", "model": "tiny", "backend": "local-held"}
            created = admin.post("/admin/v1/runs", json=body)
            assert created.status_code == 201, created.text
            run = created.json()
            assert run.get("config", {}).get("swap_mode", "keep") == "keep"
            stack = Stack(url, run, admin, lambda _: None, {})
            warm = stack.openai("warm").chat.completions.create(
                model="keep", messages=QUESTION, max_tokens=2
            )
            assert _extra(warm, "version_starts") is None  # loads the backend
            yield KeepStack(stack, settings.data_dir / "rlgate.db", tiny_model_dir)
    finally:
        registry.unregister("local-held")
        HeldLocalBackend.current = None


def _stored_starts(keep: KeepStack, completion_id: str) -> Any:
    with contextlib.closing(sqlite3.connect(f"file:{keep.db}?mode=ro", uri=True)) as conn:
        (value,) = conn.execute(
            "SELECT version_starts FROM completions WHERE id = ?", (completion_id,)
        ).fetchone()
    return None if value is None else json.loads(value)


def test_a_real_keep_swap_mid_call_is_answered_and_stored(keep: KeepStack) -> None:
    client = keep.stack.openai("keep-chat")
    answer, version = keep.across_a_swap(
        lambda: client.chat.completions.create(
            model="keep", messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0.0
        )
    )
    starts = [[0, version - 1], [HELD_AT + 1, version]]
    assert answer.usage.completion_tokens > HELD_AT + 1, "it ended before the swap landed"
    assert _extra(answer, "version_starts") == starts
    assert _extra(answer, "policy_version") == version - 1  # the oldest, the first token's
    assert _stored_starts(keep, answer.id) == starts

    # the next call starts on the new version: one version, none recorded
    after = client.chat.completions.create(model="keep", messages=QUESTION, max_tokens=4)
    assert _extra(after, "policy_version") == version
    assert _extra(after, "version_starts") is None
    assert _stored_starts(keep, after.id) is None


def test_a_real_keep_swap_mid_stream_is_on_the_final_chunk_and_event(keep: KeepStack) -> None:
    client = keep.stack.openai("keep-stream")
    chunks, version = keep.across_a_swap(
        lambda: list(
            client.chat.completions.create(
                model="keep",
                messages=QUESTION,
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                stream=True,
            )
        )
    )
    starts = [[0, version - 1], [HELD_AT + 1, version]]
    assert chunks[-1].choices[0].finish_reason is not None
    assert _extra(chunks[-1], "version_starts") == starts
    assert _stored_starts(keep, chunks[0].id) == starts

    events, version = keep.across_a_swap(
        lambda: list(
            client.responses.create(
                model="keep", input="what is one plus two?", max_output_tokens=MAX_TOKENS,
                temperature=0.0, stream=True,
            )
        )
    )  # fmt: skip
    starts = [[0, version - 1], [HELD_AT + 1, version]]
    final = events[-1].response
    assert _extra(final, "version_starts") == starts
    assert _stored_starts(keep, _extra(final, "completion_id")) == starts
