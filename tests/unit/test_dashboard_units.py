"""Pure pieces of the admin API and dashboard: session signing, token colours, the tar
stream, the quota token counter, the metric series mapping."""

from __future__ import annotations

import base64
import io
import json
import tarfile

import pytest

from core.store.models import TrainStep
from gateway.admin.metrics import _point
from gateway.admin.run_ops import tar_stream
from gateway.dashboard.auth import SessionSigner
from gateway.dashboard.pages import logprob_colour


def test_session_cookie_round_trip_tamper_and_expiry() -> None:
    signer = SessionSigner("admin-key")
    cookie, session = signer.issue()
    assert signer.verify(cookie) == session
    body, sig = cookie.rsplit(".", 1)
    forged = json.dumps({"exp": session.expires + 10**6, "csrf": session.csrf}).encode()
    forged_body = base64.urlsafe_b64encode(forged).decode().rstrip("=")
    assert signer.verify(f"{forged_body}.{sig}") is None  # payload changed, signature not
    assert signer.verify(body + "." + "0" * len(sig)) is None
    assert signer.verify("garbage") is None and signer.verify(None) is None
    assert SessionSigner("other-admin-key").verify(cookie) is None  # new credential: logged out
    expired_cookie, _ = SessionSigner("admin-key", ttl_s=-1).issue()
    assert signer.verify(expired_cookie) is None
    assert signer.issue()[1].csrf != session.csrf  # one CSRF token per session


@pytest.mark.parametrize(
    ("logprob", "hue"), [(0.0, 120), (-0.6931471805599453, 60), (-50.0, 0), (-1e-9, 120)]
)
def test_logprob_colour(logprob: float, hue: int) -> None:
    assert logprob_colour(logprob) == f"hsl({hue}, 75%, 78%)"


def test_logprob_colour_of_missing_or_broken_values_is_grey() -> None:
    assert logprob_colour(None) == logprob_colour(float("nan")) == "hsl(0, 0%, 88%)"


def test_tar_stream_reads_back(tmp_path) -> None:
    (tmp_path / "sub").mkdir()
    files = {"a.json": b"{}", "sub/weights.bin": bytes(range(256)) * 5000, "empty": b""}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    raw = b"".join(tar_stream(tmp_path, "ckpt", chunk=4096))
    assert len(raw) % tarfile.BLOCKSIZE == 0
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    assert got == {f"ckpt/{k}": v for k, v in files.items()}


def test_metric_point_prefers_kl_to_the_base_model() -> None:
    row = TrainStep(
        run_id="r",
        step=3,
        status="done",
        loss=0.5,
        reward_mean=0.25,
        reward_std=0.1,
        duration_s=2.0,
        metrics={"approx_kl": 0.01, "kl_ref": 0.2, "entropy": 1.5, "staleness_histogram": {}},
    )
    point = _point(row)
    assert point.step == 3 and point.version == 4 and point.time is None
    assert point.values["kl"] == 0.2 and point.values["loss"] == 0.5
    assert point.values["clip_frac"] is None  # absent, not zero
    row.metrics = {"approx_kl": 0.01}
    assert _point(row).values["kl"] == 0.01
