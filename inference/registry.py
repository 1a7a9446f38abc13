"""The backend kinds this install knows ("local", "vllm", "sglang", ...) and what each one needs.

Every place that lets a user pick a backend reads this table: the CLI's
`--backend` choices (`rlgate runs create`, `rlgate inference serve`, `rlgate
demo`), `RunCreate` validation, the gateway's `BackendPool` (which builds a
run's backend) and `inference.launch` (which starts a server). Adding a
backend is one module (usually an `inference.http_backend.HttpBackend`
subclass, plus a `server_command` if `rlgate inference serve` should start
its server) and one `register(BackendKind(...))` call::

    register(BackendKind(
        "mysrv", label="MyServer",
        connect="mypkg.mysrv_http:MySrvBackend.for_url",
        server_command="mypkg.mysrv_http:server_command",
        python_setting="mysrv_python",
    ))

Callables are named as "module:attribute" strings and imported on first use,
so importing this table stays cheap (nothing of torch, httpx or vLLM).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from core.config import ServerCredentials
    from inference.backend import InProcessBackend
    from inference.launch import ServerConfig
    from inference.swap import ServerClient

Ref = str | Callable[..., Any]  # "package.module:attr.attr", or the callable itself


def resolve(ref: Ref) -> Callable[..., Any]:
    """The callable `ref` names (imported now), or `ref` itself."""
    if callable(ref):
        return ref
    module, _, attr = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class BackendKind:
    """One kind of inference backend and the hooks the rest of rlgate needs from it.

    Exactly one of `connect` (served by remote servers, registered per run as
    replicas) and `load` (in the gateway's process) is set.
    """

    name: str  # what `--backend` and `RunCreate.backend` accept
    label: str = ""  # in messages, e.g. "vLLM"; default: `name`
    # remote: (url: str, version: int, credentials: ServerCredentials | None) -> Backend for
    # the server at `url`
    connect: Ref | None = None
    # in-process: (weights dir, *, version, max_batch_size, decode, threads, kv_cache_bytes,
    # prefix_cache_bytes) -> Backend with .max_context (threads: torch threads of the thread
    # that runs the model; 0: torch's)
    load: Ref | None = None
    # (ServerConfig) -> argv starting the server; None: `rlgate inference serve` cannot start it
    server_command: Ref | None = None
    # (ServerConfig, env: dict) -> None: adds what the server needs to its environment
    server_env: Ref | None = None
    python_setting: str | None = None  # Settings field with the server's python (RLGATE_...)
    default_python: Ref | None = None  # () -> Path when that setting is empty; None: required
    stub_flavor: str | None = None  # the API `inference.stub_server` speaks to stand in for it

    def __post_init__(self) -> None:
        if (self.connect is None) == (self.load is None):
            raise ValueError(f"backend {self.name!r}: set exactly one of connect and load")

    @property
    def title(self) -> str:
        return self.label or self.name

    @property
    def remote(self) -> bool:
        """Served by HTTP servers that are registered with a run as its replicas."""
        return self.connect is not None

    def connect_to(
        self, url: str, version: int = 0, credentials: ServerCredentials | None = None
    ) -> ServerClient:
        """The backend of the server at `url` (its weights assumed to be `version`), which
        presents `credentials` to it and to the trainer's weight server."""
        if self.connect is None:
            raise ValueError(f"backend {self.name!r} runs in-process, not behind a URL")
        return resolve(self.connect)(url, version, credentials)

    def load_local(self, source: Path, version: int, **kwargs: Any) -> InProcessBackend:
        """An in-process backend serving the weights in `source` as `version`."""
        if self.load is None:
            raise ValueError(f"backend {self.name!r} is remote: it needs a server URL")
        return resolve(self.load)(source, version=version, **kwargs)

    def command(self, cfg: ServerConfig) -> list[str]:
        """The command line that starts this kind's server for `cfg`."""
        if self.server_command is None:
            raise ValueError(f"rlgate cannot start a {self.title} server")
        return list(resolve(self.server_command)(cfg))

    def add_env(self, cfg: ServerConfig, env: dict[str, str]) -> None:
        if self.server_env is not None:
            resolve(self.server_env)(cfg, env)


# The built-in kinds: small specs only; their modules are imported on first use.
_KINDS: dict[str, BackendKind] = {
    spec.name: spec
    for spec in (
        BackendKind("local", label="local (transformers)", load="inference.local:LocalBackend"),
        BackendKind(
            "vllm",
            label="vLLM",
            connect="inference.vllm_http:VLLMBackend.for_url",
            server_command="inference.vllm_http:server_command",
            server_env="inference.vllm_http:server_env",
            python_setting="vllm_python",
            default_python="inference.launch:default_vllm_python",
            stub_flavor="vllm",
        ),
        BackendKind(
            "sglang",
            label="SGLang",
            connect="inference.sglang_http:SGLangBackend.for_url",
            server_command="inference.sglang_http:server_command",
            python_setting="sglang_python",
            stub_flavor="sglang",
        ),
    )
}


class UnknownBackend(ValueError):
    """No backend kind of that name is registered."""


def register(kind: BackendKind, *, replace: bool = False) -> None:
    """Make `kind` available everywhere a backend is chosen (in this process)."""
    if kind.name in _KINDS and not replace:
        raise ValueError(f"backend {kind.name!r} is already registered")
    _KINDS[kind.name] = kind


def unregister(name: str) -> None:
    _KINDS.pop(name, None)


def get(name: str) -> BackendKind:
    try:
        return _KINDS[name]
    except KeyError:
        known = ", ".join(_KINDS)
        raise UnknownBackend(f"unknown backend {name!r}; known: {known}") from None


def names() -> list[str]:
    """Every registered kind, built-ins first."""
    return list(_KINDS)


def remote_names() -> list[str]:
    """The kinds whose runs are served by registered replica servers."""
    return [k.name for k in _KINDS.values() if k.remote]


def servable_names() -> list[str]:
    """The kinds whose server `rlgate inference serve` can start."""
    return [k.name for k in _KINDS.values() if k.server_command is not None]


def startable_names() -> list[str]:
    """The kinds one command can bring up: in-process ones, and those with a server_command."""
    return [k.name for k in _KINDS.values() if not k.remote or k.server_command is not None]
