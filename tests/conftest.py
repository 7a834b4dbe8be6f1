"""Shared fixtures: the tiny model, the pool factory, the in-process pool."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.inproc_pool import InprocPool
from tests.pool_factory import PoolFactory, plan_from, pool_fixture

#: ``subprocess.Popen`` itself, for the guard below to call.
_POPEN = subprocess.Popen

#: The session's pool factories (one per run; a list for the summary hook).
_FACTORIES: list[PoolFactory] = []
#: Which modules will ask for which pools (``pytest_collection_finish``).
_PLAN: list = []


#: The layers' weight type of the tests' model: a block quant, so the real-
#: path tests take llama.cpp's quantized kernels as users' models do (Q4_0:
#: repacked on AVX2, the AMX kernel on AMX), and a crash in one of them
#: fails ``make test`` on the machine that has it. F32 would take neither.
TEST_MODEL_QUANT = "q4_0"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The random-weight test GGUF, written by the real CLI command (through
    ``_POPEN``: the unit tier's tests load it too, and the guard below does
    not count this one process against them)."""
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    proc = _POPEN(
        [sys.executable, "-m", "llamapool", "make-test-model", str(path),
         "--quant", TEST_MODEL_QUANT],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    output, _ = proc.communicate()
    assert proc.returncode == 0, output.decode(errors="replace")
    return path


@pytest.fixture(scope="session")
def pool_factory(tiny_model, tmp_path_factory):
    """Running pools by their options, shared by every module that asks with
    equal ones (``tests/pool_factory.py``)."""
    factory = PoolFactory(tiny_model, tmp_path_factory.mktemp, plan=_PLAN or None)
    _FACTORIES.append(factory)
    yield factory
    factory.close()


#: Broker + 2 workers + gunicorn on the tiny model: the session's default
#: pool, handed to each module that uses it in turn.
pool = pool_fixture(workers=2)


@pytest.fixture
def whole_pool(pool):
    """The shared pool, checked whole (free slots == live workers) after the test."""
    yield pool
    pool.assert_whole()


@pytest.fixture(scope="module")
def inproc_pool():
    """Broker and 2 synthetic workers in threads, on ``inproc://``: for the
    frontend's own logic, in process (``tests/inproc_pool.py``). Its
    ``client(**frontend_settings)`` is a Falcon ``TestClient``."""
    p = InprocPool(workers=2)
    try:
        yield p
        p.assert_whole()
    finally:
        p.stop()


def _unmarked_popen(nodeid: str):
    class UnmarkedPopen(_POPEN):
        def __init__(self, args, *rest, **kwargs):
            pytest.fail(f"{nodeid} starts a process ({args!r}) "
                        "without @pytest.mark.stack", pytrace=False)

    return UnmarkedPopen


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test that starts a process (a pool, a CLI command) must say so with
    ``@pytest.mark.stack``: ``make test-unit`` runs the others alone, and
    must stay fast and free of processes. The guard spans the test's whole
    setup, so a module- or session-scoped fixture that an unmarked test is
    the first to ask for (a pool) is caught too; the session's tiny model
    is written through ``_POPEN`` and is not."""
    if item.get_closest_marker("stack") is not None:
        return (yield)
    patch = pytest.MonkeyPatch()
    patch.setattr(subprocess, "Popen", _unmarked_popen(item.nodeid))
    try:
        return (yield)
    finally:
        patch.undo()


def pytest_collection_finish(session):
    _PLAN[:] = plan_from(session.items)


def pytest_terminal_summary(terminalreporter):
    for factory in _FACTORIES:
        if factory.started:
            terminalreporter.write_line(f"pool factory: {factory.summary()}")
