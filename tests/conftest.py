"""Shared fixtures: the tiny model and a real pool of processes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.pool import Pool

#: ``subprocess.Popen`` itself, for the guard below to call.
_POPEN = subprocess.Popen


#: The layers' weight type of the tests' model: a block quant, so the real-
#: path tests take llama.cpp's quantized kernels as users' models do (Q4_0:
#: repacked on AVX2, the AMX kernel on AMX), and a crash in one of them
#: fails ``make test`` on the machine that has it. F32 would take neither.
TEST_MODEL_QUANT = "q4_0"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The random-weight test GGUF, written by the real CLI command."""
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    subprocess.run(
        [sys.executable, "-m", "llamapool", "make-test-model", str(path),
         "--quant", TEST_MODEL_QUANT],
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


@pytest.fixture(autouse=True)
def processes_need_the_stack_mark(request, monkeypatch):
    """A test that starts a process (a pool, a CLI command) must say so with
    ``@pytest.mark.stack``: ``make test-unit`` runs the others alone, and
    must stay fast and free of processes. Session fixtures (the tiny model,
    written by the real CLI) are made before this guard applies."""
    if request.node.get_closest_marker("stack") is not None:
        return

    class UnmarkedPopen(_POPEN):
        def __init__(self, args, *rest, **kwargs):
            pytest.fail(f"{request.node.nodeid} starts a process ({args!r}) "
                        "without @pytest.mark.stack", pytrace=False)

    monkeypatch.setattr(subprocess, "Popen", UnmarkedPopen)
