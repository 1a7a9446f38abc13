"""Redis never redelivers a train step that is still running within the step timeout.

Celery on Redis redelivers an unacknowledged task after the transport's visibility
timeout (1 h by default); a step may legitimately run up to `step_timeout_s`, after
which the gateway resends it itself. The timeout the worker and the gateway use is
derived from the step timeout, with a margin.
"""

from __future__ import annotations

import pytest

from core.settings import Settings
from trainer.celery_app import make_celery


@pytest.mark.parametrize("step_timeout_s", [60.0, 1800.0, 3600.0, 4 * 3600.0])
def test_visibility_timeout_exceeds_the_step_timeout(step_timeout_s: float, tmp_path) -> None:
    settings = Settings(
        data_dir=tmp_path,
        broker_url="redis://127.0.0.1:6379/0",
        step_timeout_s=step_timeout_s,
        dev_mode=False,
    )
    app = make_celery(settings.queue())
    try:
        visibility = app.conf.broker_transport_options["visibility_timeout"]
        assert visibility >= step_timeout_s + 300, visibility
        # what the worker's channel really uses, not only what was configured
        with app.connection_for_write() as conn:
            assert conn.default_channel.visibility_timeout == visibility
    finally:
        app.close()
