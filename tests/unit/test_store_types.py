"""IntArray / FloatArray: packed little-endian columns round-trip through a real SQLite table."""

from __future__ import annotations

import math
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import Column, Integer, MetaData, Table, insert, select, text
from sqlalchemy.exc import SAWarning, StatementError

from core.store.db import make_sync_engine
from core.store.types import FloatArray, IntArray

# The cache-key warning is the bug pinned by test_packed_array_types_are_cacheable below.
pytestmark = pytest.mark.filterwarnings("ignore:TypeDecorator .* will not produce a cache key")

metadata = MetaData()
arrays = Table(
    "arrays",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("ids", IntArray, nullable=True),
    Column("lps", FloatArray, nullable=True),
)


@pytest.fixture
def engine(tmp_path: Path):
    eng = make_sync_engine(f"sqlite:///{tmp_path / 'types.db'}")
    metadata.create_all(eng)
    yield eng
    eng.dispose()


def _roundtrip(engine, ids, lps):
    with engine.begin() as conn:
        pk = conn.execute(insert(arrays).values(ids=ids, lps=lps)).inserted_primary_key[0]
    with engine.connect() as conn:
        row = conn.execute(select(arrays.c.ids, arrays.c.lps).where(arrays.c.id == pk)).one()
        raw = conn.execute(text("SELECT ids, lps FROM arrays WHERE id = :i"), {"i": pk}).one()
    return row, raw


def test_token_ids_roundtrip_exactly(engine) -> None:
    ids = [0, 1, 2, 399, 151_643, 2**31 - 1, -(2**31), -1]
    row, raw = _roundtrip(engine, ids, [0.0] * len(ids))
    assert row.ids == ids
    assert all(type(i) is int for i in row.ids)
    # 4 bytes per id, little-endian, whatever the host byte order
    assert bytes(raw.ids) == struct.pack(f"<{len(ids)}i", *ids)


def test_logprobs_roundtrip_as_float32(engine) -> None:
    lps = [-0.1, -2.302585092994046, -1e-8, -50.25, 0.0, -math.inf]
    row, raw = _roundtrip(engine, [1] * len(lps), lps)
    assert row.lps == [float(np.float32(x)) for x in lps]
    assert row.lps[-1] == -math.inf
    assert row.lps[:5] == pytest.approx(lps[:5], rel=1e-6, abs=1e-12)
    assert bytes(raw.lps) == struct.pack(f"<{len(lps)}f", *lps)


def test_long_sequences_roundtrip(engine) -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50_000, size=4096).tolist()
    lps = (-rng.exponential(2.0, size=4096)).astype(np.float32).tolist()
    row, raw = _roundtrip(engine, ids, lps)
    assert row.ids == ids
    assert row.lps == lps  # float32 values survive bit-exactly
    assert len(bytes(raw.ids)) == 4 * 4096


def test_empty_and_null(engine) -> None:
    row, _ = _roundtrip(engine, [], [])
    assert row.ids == [] and row.lps == []
    row, raw = _roundtrip(engine, None, None)
    assert row.ids is None and row.lps is None
    assert raw.ids is None


def test_out_of_range_token_id_fails_loudly(engine) -> None:
    # Silently wrapping 2**31 to a negative id would corrupt training data.
    with pytest.raises(StatementError), engine.begin() as conn:
        conn.execute(insert(arrays).values(ids=[2**31], lps=[0.0]))


@pytest.mark.parametrize("column_type", [IntArray, FloatArray])
def test_packed_array_types_are_cacheable(column_type) -> None:
    m = MetaData()
    t = Table("t", m, Column("id", Integer, primary_key=True), Column("x", column_type))
    eng = make_sync_engine("sqlite://")
    m.create_all(eng)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SAWarning)
        with eng.connect() as conn:
            conn.execute(select(t.c.x)).all()
    eng.dispose()
