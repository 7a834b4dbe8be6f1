"""The module gunicorn loads: ``frontend.wsgi:app``."""

from __future__ import annotations

from frontend.app import create_app
from frontend.settings import FrontendSettings

app = create_app(FrontendSettings.from_env())
