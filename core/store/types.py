"""Compact column types: token ids and logprobs as packed little-endian arrays, not JSON."""

from __future__ import annotations

import array
import sys

from sqlalchemy import LargeBinary
from sqlalchemy.types import TypeDecorator


class _PackedArray(TypeDecorator):
    impl = LargeBinary
    cache_ok = True
    typecode = "i"

    def process_bind_param(self, value, dialect):
        if value is None:
            return None
        packed = array.array(self.typecode, value)
        if sys.byteorder != "little":
            packed.byteswap()
        return packed.tobytes()

    def process_result_value(self, value, dialect):
        if value is None:
            return None
        packed = array.array(self.typecode)
        packed.frombytes(bytes(value))
        if sys.byteorder != "little":
            packed.byteswap()
        return packed.tolist()


class IntArray(_PackedArray):
    """A list of int32 token ids stored as 4 bytes each."""

    typecode = "i"
    cache_ok = True


class FloatArray(_PackedArray):
    """A list of float32 log-probabilities stored as 4 bytes each."""

    typecode = "f"
    cache_ok = True
