"""Agent API keys: random, shown once, stored as a SHA-256 hash, looked up by hash."""

from __future__ import annotations

import hashlib
import secrets

KEY_PREFIX = "rlg-"


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def display_prefix(key: str) -> str:
    return key[:12]


def admin_key_matches(given: str, expected: str) -> bool:
    return secrets.compare_digest(given.encode(), expected.encode())
