"""``llamapool frontend``: run gunicorn on the Falcon app.

The app is forked into gunicorn workers, so settings travel as ``LLAMAPOOL_*``
environment variables (``protocol.settings.to_env``; ``llamapool.wsgi`` reads
them back into ``frontend.settings.FrontendSettings``).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from llamapool.exit_codes import ExitCode


def gunicorn_config_path() -> Path:
    """``deploy/gunicorn.conf.py`` beside the packages (source or editable install)."""
    override = os.environ.get("LLAMAPOOL_GUNICORN_CONFIG")
    if override:
        return Path(override)
    return Path(__file__).resolve().parent.parent / "deploy" / "gunicorn.conf.py"


def gunicorn_argv() -> list[str]:
    config = gunicorn_config_path()
    if not config.is_file():
        print(f"llamapool frontend: gunicorn config not found at {config}; set "
              "LLAMAPOOL_GUNICORN_CONFIG", file=sys.stderr)
        sys.exit(ExitCode.NO_CONFIG)
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
