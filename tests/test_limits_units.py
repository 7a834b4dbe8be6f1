"""The small pieces behind the broker's limits: log throttle, restart table,
settings bounds."""

from __future__ import annotations

import logging

import pytest

from protocol import limits
from protocol.log_throttle import LogThrottle
from protocol.settings import ConfigError, load
from workers.broker.restarts import HostDeaths
from workers.broker.settings import BrokerSettings
from workers.model.settings import WorkerSettings


def test_log_throttle_lets_a_burst_through_per_window_and_counts_the_rest(caplog):
    now = [0.0]
    throttle = LogThrottle(logging.getLogger("t"), burst=3, window_s=60,
                           clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="t"):
        logged = [throttle.info("lost", "worker lost %d", i) for i in range(1000)]
        assert sum(logged) == 3
        assert throttle.info("other", "another kind")  # its own budget
        now[0] = 61.0
        assert throttle.info("lost", "worker lost %d", 1000)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 5
    assert lines[-1] == "worker lost 1000 (997 similar lines held back)"


def test_host_deaths_are_bounded_and_leave_nothing_behind():
    deaths = HostDeaths(max_hosts=100)
    for i in range(10_000):  # unique host names, each dying once
        deaths.died(f"fake-{i}")
    assert len(deaths) == 100
    assert deaths.registered("fake-9999")  # the newest are kept
    assert not deaths.registered("fake-0")
    for _ in range(1000):
        deaths.died("real")
    assert sum(deaths.registered("real") for _ in range(1000)) == 100  # capped
    assert not deaths.registered("real")
    for i in range(9900, 9999):
        deaths.registered(f"fake-{i}")
    assert len(deaths) == 0  # no zero counts kept


def test_restarts_are_still_counted_per_host():
    deaths = HostDeaths(max_hosts=4)
    deaths.died("a")
    deaths.died("a")
    assert deaths.registered("a") and deaths.registered("a")
    assert not deaths.registered("a")


@pytest.mark.parametrize("env,why", [
    ({"LLAMAPOOL_MAX_WORKERS": "0"}, "MAX_WORKERS"),
    ({"LLAMAPOOL_MAX_WORKERS": "20000"}, "MAX_WORKERS"),
    ({"LLAMAPOOL_FIRST_FRAME_TIMEOUT_S": "0"}, "FIRST_FRAME"),
])
def test_broker_limits_settings_are_checked(env, why):
    base = {"LLAMAPOOL_FRONTENDS_ENDPOINT": "ipc://f",
            "LLAMAPOOL_WORKERS_ENDPOINT": "ipc://w"}
    assert load(BrokerSettings, base).max_workers == 1024
    with pytest.raises(ConfigError, match=why):
        load(BrokerSettings, {**base, **env})


def test_a_worker_name_the_broker_would_refuse_is_refused_at_startup():
    env = {"LLAMAPOOL_BROKER": "ipc://w",
           "LLAMAPOOL_WORKER_NAME": "w" * (limits.MAX_NAME_CHARS + 1)}
    with pytest.raises(ConfigError, match="LLAMAPOOL_WORKER_NAME"):
        load(WorkerSettings, env)


def test_a_request_too_large_for_the_wire_is_refused_by_the_frontend():
    """The broker would drop a SUBMIT over its ceiling as malformed and the
    client would wait for nothing: the frontend answers 413 instead."""
    from frontend.broker_link import BrokerLink
    from frontend.errors import PayloadTooLarge
    from protocol.payloads import GenerationRequest

    link = BrokerLink("ipc:///nonexistent/llamapool-test", heartbeat_interval_s=1,
                      heartbeat_liveness=3)
    try:
        big = GenerationRequest("completion", "x" * limits.MAX_SUBMIT_BYTES)
        with pytest.raises(PayloadTooLarge, match="at most"):
            link.submit("j", big)
        assert "j" not in link._streams
        fits = GenerationRequest("completion", "x" * (limits.MAX_SUBMIT_BYTES // 2))
        link.submit("k", fits)  # sent (to no broker)
    finally:
        link.close()
