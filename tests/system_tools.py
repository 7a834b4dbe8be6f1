"""System tools (Debian packages) that some tests drive for real.

On a developer machine a missing tool skips its tests with the reason. CI
(``.ci/run``) installs them and sets ``LLAMAPOOL_REQUIRE_TOOLS=1``; there a
missing tool is a failure, so a broken install cannot pass as skipped tests.
"""

from __future__ import annotations

import os
import shutil

import pytest


def unavailable(reason: str):
    """Skip, unless CI installed the tools (then it is a failure)."""
    if os.environ.get("LLAMAPOOL_REQUIRE_TOOLS") == "1":
        pytest.fail(f"{reason}, but LLAMAPOOL_REQUIRE_TOOLS=1 (.ci/run)")
    pytest.skip(reason)


def require_tool(name: str) -> str:
    """The path of a system tool the test drives for real."""
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if path is None:
        unavailable(f"{name} is not installed")
    return path
