"""``llamapool frontend``: run gunicorn on the Falcon app.

The app is forked into gunicorn workers, so settings travel as ``LLAMAPOOL_*``
environment variables (read by ``frontend.settings``).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

#: Exit code when the gunicorn config cannot be found.
EXIT_NO_CONFIG = 4


def gunicorn_config_path() -> Path:
    """``deploy/gunicorn.conf.py`` beside the packages (source or editable install)."""
    override = os.environ.get("LLAMAPOOL_GUNICORN_CONFIG")
    if override:
        return Path(override)
    return Path(__file__).resolve().parent.parent / "deploy" / "gunicorn.conf.py"


def frontend_env(
    broker: str,
    bind: str,
    api_keys: list[str],
    api_key_file: str | None,
    extra: dict[str, str] | None = None,
) -> dict[str, str]:
    env = dict(os.environ)
    env["LLAMAPOOL_BROKER"] = broker
    env["LLAMAPOOL_BIND"] = bind
    if api_keys:
        env["LLAMAPOOL_API_KEYS"] = ",".join(api_keys)
    if api_key_file:
        env["LLAMAPOOL_API_KEY_FILE"] = api_key_file
    env.update(extra or {})
    return env


def gunicorn_argv() -> list[str]:
    config = gunicorn_config_path()
    if not config.is_file():
        print(f"llamapool frontend: gunicorn config not found at {config}; set "
              "LLAMAPOOL_GUNICORN_CONFIG", file=sys.stderr)
        sys.exit(EXIT_NO_CONFIG)
    return [sys.executable, "-m", "gunicorn", "-c", str(config), "llamapool.wsgi:app"]


def exec_gunicorn(env: dict[str, str]) -> None:
    """Replace this process with gunicorn, so signals reach its arbiter directly.

    Prometheus multiprocess mode needs ``PROMETHEUS_MULTIPROC_DIR`` before
    Python starts in the workers; a private directory is made unless one is
    given (gunicorn's ``on_starting`` hook wipes it either way).
    """
    if not env.get("PROMETHEUS_MULTIPROC_DIR"):
        env["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="llamapool-prom-")
    argv = gunicorn_argv()
    os.execve(argv[0], argv, env)
