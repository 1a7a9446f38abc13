"""Agent API keys: random, shown once, stored as a SHA-256 hash, looked up by hash.

Also the admin credential's two checks: the key itself, compared in constant time,
and where it may come from. The development key (`core.settings.DEV_ADMIN_KEY`) is
published in the docs, so it opens the admin API only to a loopback peer; the check
is per request, on the peer address, because an app factory (`uvicorn --factory`)
cannot know the address it is bound to. uvicorn takes the peer from
`X-Forwarded-For` when the connection comes from 127.0.0.1 (its default
`forwarded_allow_ips`), so a proxy on the same host that sets the header does not
make every caller local; one that does not set it does (docs/security.md).
"""

from __future__ import annotations

import hashlib
import secrets

from core.settings import DEV_ADMIN_KEY, is_loopback

KEY_PREFIX = "rlg-"
DEV_KEY_OFF_LOOPBACK = (
    "the development admin key is accepted only from loopback peers: set RLGATE_ADMIN_KEY"
)


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def display_prefix(key: str) -> str:
    return key[:12]


def admin_key_matches(given: str, expected: str) -> bool:
    return secrets.compare_digest(given.encode(), expected.encode())


def dev_key_refused(expected: str, peer: str | None) -> bool:
    """Whether the admin credential is the development key and `peer` is not on loopback.

    `peer` is the client's address as the server saw it (`request.client.host`); a
    request without one (a Unix socket, a test transport without a client) is refused.
    """
    return secrets.compare_digest(expected.encode(), DEV_ADMIN_KEY.encode()) and not (
        peer and is_loopback(peer)
    )
