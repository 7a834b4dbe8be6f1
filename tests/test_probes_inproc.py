"""The probes' own logic, in process (the real-process checks are in
``tests/test_probes.py``)."""

from __future__ import annotations

import pytest

from llamapool.probe import ProbeFailed, check_broker, check_worker
from tests.inproc_pool import InprocPool

WORKER_OK = {"llamapool_worker_link_beat_age_seconds": 0.4,
             "llamapool_worker_loaded": 1.0, "llamapool_worker_registered": 1.0}


def test_worker_levels_each_need_more():
    assert check_worker(WORKER_OK, "registered", 30).startswith("worker registered")
    loading = {**WORKER_OK, "llamapool_worker_loaded": 0.0,
               "llamapool_worker_registered": 0.0}
    assert check_worker(loading, "alive", 30)
    with pytest.raises(ProbeFailed, match="not loaded"):
        check_worker(loading, "loaded", 30)
    unregistered = {**WORKER_OK, "llamapool_worker_registered": 0.0}
    assert check_worker(unregistered, "loaded", 30)
    with pytest.raises(ProbeFailed, match="no broker holds"):
        check_worker(unregistered, "registered", 30)


def test_a_stale_or_missing_beat_fails_every_level():
    stale = {**WORKER_OK, "llamapool_worker_link_beat_age_seconds": 31.0}
    with pytest.raises(ProbeFailed, match="stuck"):
        check_worker(stale, "alive", 30)
    with pytest.raises(ProbeFailed, match="not beaten"):
        check_broker({"llamapool_slots_registered": 3.0}, 0, 30)


def test_broker_min_slots():
    values = {"llamapool_broker_loop_beat_age_seconds": 0.1,
              "llamapool_slots_registered": 1.0}
    assert "1 loaded slots" in check_broker(values, 1, 30)
    with pytest.raises(ProbeFailed, match="fewer than 2"):
        check_broker(values, 2, 30)


@pytest.fixture(scope="module")
def empty_inproc():
    pool = InprocPool(workers=0)
    try:
        yield pool
    finally:
        pool.stop()


def test_readyz_needs_a_worker_livez_does_not(empty_inproc):
    client = empty_inproc.client(api_keys=("k" * 24,))
    # Public: a kubelet sends no key.
    assert client.simulate_get("/livez").status_code == 200
    readyz = client.simulate_get("/readyz")
    assert readyz.status_code == 503
    assert readyz.json["error"]["type"] == "unavailable_error"
    assert client.simulate_get("/v1/completions").status_code == 401
