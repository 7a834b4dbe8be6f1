"""The module gunicorn loads: ``llamapool.wsgi:app``."""

from __future__ import annotations

import os

from frontend.app import create_app
from frontend.settings import FrontendSettings
from llamapool.log_format import configure_logging
from protocol import tracing

configure_logging(os.environ.get("LLAMAPOOL_LOG_LEVEL", "info"),
                  os.environ.get("LLAMAPOOL_LOG_FORMAT", "text"))
# In each gunicorn worker, after the fork (the batch exporter owns a thread),
# and before the app, whose middleware depends on it.
tracing.configure("frontend")
app = create_app(FrontendSettings.from_env())
