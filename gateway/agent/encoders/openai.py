"""What OpenAI's chat and text completion streams share: ids, usage chunk, in-stream errors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from core.store.models import Completion
from gateway.agent.events import StreamEncoder
from gateway.errors import APIError
from gateway.protocol import StreamOptions, Usage

if TYPE_CHECKING:
    from gateway.agent.completions import Prepared


class OpenAIChunks(StreamEncoder[dict[str, Any]]):
    """The chunks of one OpenAI-style stream, as JSON-ready dicts; subclasses lay them out."""

    def __init__(
        self,
        model: str,
        stream_options: StreamOptions | None,
        prep: Prepared,
        completion_id: str,
        created: int,
    ) -> None:
        self.model = model
        self.prep = prep
        self.id = completion_id
        self.created = created
        self.include_usage = bool(stream_options and stream_options.include_usage)
        # The version serving the call when its stream opened: the oldest of its tokens
        # (a keep-mode swap during the stream shows in the finish chunk's `version_starts`).
        self.fingerprint = f"rlgate-{prep.run.id}-v{prep.serving.backend.version}"

    def error(self, error: APIError) -> list[dict[str, Any]]:
        """OpenAI's in-stream error event; the route still ends the stream with `[DONE]`."""
        return [error.body()]

    def finished(self, last: dict[str, Any], usage: Usage, row: Completion) -> list[dict[str, Any]]:
        """The finish chunk `last`, then, if asked for, the usage chunk (`last`, no choices).

        When a keep-mode swap happened while `row` was sampled, both carry its
        `version_starts` (known only now); a completion of one version has none.
        """
        if row.version_starts:
            # --- rlgate extension: [[token index, version], ...] where each version began
            last["version_starts"] = row.version_starts
        if not self.include_usage:
            return [last]
        return [last, {**last, "choices": [], "usage": usage.model_dump()}]

    def envelope(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """`chunk` with rlgate's episode id and, when usage is asked for, `usage: null`."""
        # --- rlgate extension: the episode this call is filed under
        chunk["episode_id"] = self.prep.placement.episode_id
        if self.include_usage:
            chunk["usage"] = None
        return chunk
