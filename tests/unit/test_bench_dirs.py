"""Benches write to a temporary directory unless told where, and read models from the data dir."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlgate.bench.dirs import model_cache, work_dir
from rlgate.cli import BENCHES, build_parser


def test_work_dir_is_temporary_by_default(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with work_dir("swap") as path:
        assert path.is_dir() and path.name.startswith("rlgate-bench-swap-")
        assert tmp_path not in path.parents
        (path / "vllm.log").write_text("kept until the end")
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []


def test_work_dir_given_is_created_and_kept(tmp_path: Path) -> None:
    with work_dir("swap", tmp_path / "mine") as path:
        (path / "vllm.log").write_text("x")
    assert (tmp_path / "mine" / "vllm.log").read_text() == "x"


def test_work_dir_is_removed_when_the_bench_fails() -> None:
    with pytest.raises(RuntimeError), work_dir("e2e") as path:
        raise RuntimeError("bench failed")
    assert not path.exists()


def test_model_cache_defaults_to_the_data_dir(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("RLGATE_MODEL_CACHE_DIR", raising=False)
    monkeypatch.setenv("RLGATE_DATA_DIR", str(tmp_path))
    assert model_cache() == tmp_path
    assert model_cache("elsewhere") == Path("elsewhere")


@pytest.mark.parametrize("bench", ["capture", "e2e", "gateway", "swap", "train"])
def test_bench_directories_default_to_the_helpers(bench: str) -> None:
    assert bench in BENCHES
    args = build_parser().parse_args(["bench", bench])
    assert getattr(args, "cache_dir", None) is None
    assert getattr(args, "work_dir", None) is None
    assert callable(args.func)
