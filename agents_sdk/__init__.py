"""Client library for agents that talk to an rlgate gateway: episodes, groups and rewards.

from agents_sdk import RLGate

gate = RLGate("http://127.0.0.1:8000/v1", api_key="rlg-...")
group = gate.group()  # several attempts at one task
for _ in range(4):
    episode = group.episode()
    client = episode.openai()  # an openai.OpenAI filed under this episode
    reply = client.chat.completions.create(model="my-run", messages=[...])
    episode.reward(score(reply))
"""

from agents_sdk._base import RewardAck
from agents_sdk._client import (
    AsyncEpisode,
    AsyncGroup,
    AsyncRLGate,
    Episode,
    Group,
    RLGate,
)
from agents_sdk._exceptions import (
    APIConnectionError,
    APIResponseError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    RLGateError,
    ServerError,
)

__all__ = [
    "APIConnectionError",
    "APIResponseError",
    "APIStatusError",
    "APITimeoutError",
    "AsyncEpisode",
    "AsyncGroup",
    "AsyncRLGate",
    "AuthenticationError",
    "BadRequestError",
    "ConflictError",
    "Episode",
    "Group",
    "NotFoundError",
    "PermissionDeniedError",
    "RLGate",
    "RLGateError",
    "RateLimitError",
    "RewardAck",
    "ServerError",
]
