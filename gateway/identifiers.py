"""What an episode or group identifier may be, and how it travels in HTTP headers.

One rule for every form an id arrives in (the URL path, the `X-Episode-Id` /
`X-Group-Id` headers, a request's `metadata`, a reward's `episode_id`): 1 to
`MAX_ID_LENGTH` characters, any printable Unicode (no control, format or
separator characters other than the plain space), no `/` (a path segment could
not carry it, nor `.` or `..` alone, which URLs normalise away) and no
leading `~` (reserved). A URL carries such an id
percent-encoded as UTF-8; a request header carries it as UTF-8 bytes.

Header values are Latin-1 on the wire as far as the ASGI server is concerned,
so an id goes back out (`X-Rlgate-Episode-Id`, `X-Rlgate-Group-Id`)
percent-encoded as UTF-8: an id of letters, digits and `-._~:@` is sent as it
is, anything else as `%XX` escapes (`urllib.parse.unquote` gives the id back).
"""

from __future__ import annotations

from urllib.parse import quote

from gateway.errors import InvalidRequest

MAX_ID_LENGTH = 100
# Kept as they are in an echoed header; everything else (including `%`) is escaped.
_HEADER_SAFE = "-._~:@!$&'()*+,;="


def id_problem(value: str) -> str | None:
    """Why `value` is not a valid identifier, or None when it is."""
    if not 0 < len(value) <= MAX_ID_LENGTH:
        return f"must be 1 to {MAX_ID_LENGTH} characters"
    if not value.isprintable():
        return (
            "may contain only printable characters (no control, format or separator "
            "characters other than a space)"
        )
    if "/" in value or value in (".", ".."):
        return "may not contain '/' or be '.' or '..'"
    if value.startswith("~"):
        return "may not start with '~' (reserved)"
    return None


def checked_id(value: str, param: str) -> str:
    """`value` if it is a valid identifier, else a 400 naming `param`."""
    problem = id_problem(value)
    if problem is not None:
        raise InvalidRequest(f"{param} {problem}", param=param)
    return value


def id_from_header(raw: str | None, param: str) -> str | None:
    """An id sent in a request header: its bytes read as UTF-8 (400 when they are not)."""
    if not raw:
        return None
    try:
        return raw.encode("latin-1").decode("utf-8")
    except UnicodeError:
        raise InvalidRequest(f"{param} header is not valid UTF-8", param=param) from None


def header_value(identifier: str) -> str:
    """An id as it goes out in a response header: ASCII, percent-encoded UTF-8."""
    return quote(identifier, safe=_HEADER_SAFE)
