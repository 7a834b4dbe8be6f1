"""Shared fixtures: the tiny model and a real pool of processes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.pool import Pool


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The random-weight test GGUF, written by the real CLI command."""
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    subprocess.run(
        [sys.executable, "-m", "llamapool", "make-test-model", str(path)],
        check=True, capture_output=True,
    )
    return path


@pytest.fixture(scope="module")
def pool(tiny_model, tmp_path_factory):
    """Broker + 2 workers + gunicorn, shared by one test module."""
    run_dir = tmp_path_factory.mktemp("pool")
    p = Pool(tiny_model, run_dir, workers=2)
    yield p
    p.stop()


@pytest.fixture
def whole_pool(pool):
    """The shared pool, checked whole (free slots == live workers) after the test."""
    yield pool
    pool.assert_whole()
