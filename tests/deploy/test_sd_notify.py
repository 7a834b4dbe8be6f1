"""sd_notify without systemd: a datagram socket in tmp stands in for it.

Real broker, worker and gunicorn processes get ``NOTIFY_SOCKET`` (and a small
``WATCHDOG_USEC``) and must say READY=1 only when they can serve, ping the
watchdog in time, and say STOPPING=1 on SIGTERM, all from their main pid.
"""

from __future__ import annotations

import itertools
import os
import socket

import pytest

from llamapool import sd_notify
from tests.deploy.helpers import NotifyListener
from tests.pool import TEST_HEARTBEAT, BrokerProbe, Proc, cli, free_port, wait_until

#: 1 s watchdog: pings must come at least this often.
WATCHDOG_USEC = 1_000_000


@pytest.fixture
def listener(tmp_path):
    lst = NotifyListener(tmp_path / "notify.sock")
    yield lst
    lst.close()


def _env(listener: NotifyListener) -> dict[str, str]:
    env = dict(os.environ)
    env.update(listener.env(WATCHDOG_USEC))
    return env


def _assert_watchdog_in_time(listener: NotifyListener, pings: int) -> None:
    times = listener.wait_for("WATCHDOG=1", timeout_s=10, count=pings)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert max(gaps) < WATCHDOG_USEC / 1e6, f"watchdog gaps {gaps}"


# --- the module on its own ----------------------------------------------------


def test_no_socket_is_a_silent_no_op():
    notifier = sd_notify.Notifier({})
    assert not notifier.enabled
    assert notifier.notify("READY=1") is False
    notifier.ready()
    notifier.watchdog()
    notifier.stopping()


def test_path_socket_gets_each_state_once(listener):
    notifier = sd_notify.Notifier(listener.env(WATCHDOG_USEC))
    notifier.ready("up")
    notifier.ready("again")  # once per process
    notifier.stopping()
    listener.wait_for("STOPPING=1", timeout_s=2)
    texts = [text for _, text in listener.received]
    assert texts == ["READY=1\nSTATUS=up", "STOPPING=1"]
    assert listener.senders == [os.getpid(), os.getpid()]


def test_abstract_namespace_socket():
    name = f"llamapool-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2)
        assert sd_notify.Notifier({"NOTIFY_SOCKET": "@" + name}).notify("READY=1")
        assert sock.recv(100) == b"READY=1"


def test_watchdog_interval_and_rate_limit(listener):
    env = listener.env(WATCHDOG_USEC)
    assert sd_notify.watchdog_interval_s(env) == pytest.approx(0.5)
    # WATCHDOG_PID names another process: not ours to ping.
    assert sd_notify.watchdog_interval_s({**env, "WATCHDOG_PID": "1"}) is None
    assert sd_notify.watchdog_interval_s({**env, "WATCHDOG_USEC": "x"}) is None
    notifier = sd_notify.Notifier(env)
    for now in (100.0, 100.1, 100.2, 100.3):  # quarter period: 0.25 s
        notifier.watchdog(now)
    listener.wait_for("WATCHDOG=1", timeout_s=2, count=2)
    assert listener.absent_for("WATCHDOG=1\n", 0.05)
    assert len(listener.times("WATCHDOG=1")) == 2


# --- real processes -----------------------------------------------------------


@pytest.mark.stack
def test_broker_ready_watchdog_stopping(tmp_path, listener):
    frontends, workers = f"ipc://{tmp_path}/f", f"ipc://{tmp_path}/w"
    broker = Proc("broker", cli("broker", "--frontends", frontends,
                                "--workers", workers, *TEST_HEARTBEAT),
                  tmp_path, env=_env(listener))
    probe = BrokerProbe(frontends)
    try:
        listener.wait_for("READY=1", timeout_s=15)
        # READY means bound: the broker answers at once.
        assert probe.status(timeout_s=2) is not None
        _assert_watchdog_in_time(listener, pings=4)
    finally:
        probe.close()
        code = broker.stop()
    assert code == 0
    (stopping,) = listener.wait_for("STOPPING=1", timeout_s=2)
    assert stopping > listener.times("READY=1")[0]
    assert set(listener.senders) == {broker.pid}


@pytest.mark.stack
def test_worker_ready_only_once_registered(tmp_path, listener, tiny_model):
    frontends, workers = f"ipc://{tmp_path}/f", f"ipc://{tmp_path}/w"
    worker = Proc("worker", cli("worker", "--broker", workers, "--model",
                                str(tiny_model), "--threads", "1", *TEST_HEARTBEAT),
                  tmp_path, env=_env(listener))
    broker = None
    probe = BrokerProbe(frontends)
    try:
        # The model is loaded and READY is sent, but no broker answers yet.
        wait_until(lambda: "sent READY" in worker.log(), 30, "the worker to load")
        assert listener.absent_for("READY=1", 1.0), "READY=1 before registering"
        broker = Proc("broker", cli("broker", "--frontends", frontends,
                                    "--workers", workers, *TEST_HEARTBEAT), tmp_path)
        listener.wait_for("READY=1", timeout_s=15)
        # The broker had the worker in its ledger before it answered it.
        snap = probe.status(timeout_s=2)
        assert snap is not None and snap["slots_total"] == 1
        _assert_watchdog_in_time(listener, pings=4)
        code = worker.stop()
        assert code == 0
        (stopping,) = listener.wait_for("STOPPING=1", timeout_s=2)
        assert stopping > listener.times("READY=1")[0]
        assert set(listener.senders) == {worker.pid}
    finally:
        probe.close()
        if worker.alive():
            worker.kill()
        if broker is not None:
            assert broker.stop() == 0


@pytest.mark.stack
def test_gunicorn_arbiter_ready_and_watchdog(tmp_path, listener):
    frontends, workers = f"ipc://{tmp_path}/f", f"ipc://{tmp_path}/w"
    broker = Proc("broker", cli("broker", "--frontends", frontends,
                                "--workers", workers, *TEST_HEARTBEAT), tmp_path)
    env = _env(listener)
    env["LLAMAPOOL_FRONTEND_PROCESSES"] = "1"
    port = free_port()
    frontend = Proc("frontend", cli("frontend", "--broker", frontends, "--bind",
                                    f"127.0.0.1:{port}", *TEST_HEARTBEAT),
                    tmp_path, env=env)
    try:
        listener.wait_for("READY=1", timeout_s=30)
        _assert_watchdog_in_time(listener, pings=4)
        # gunicorn exec'd in place of `llamapool frontend`: the unit's main pid
        # is the arbiter, which is the only sender (NotifyAccess=main).
        assert set(listener.senders) == {frontend.pid}
    finally:
        codes = [frontend.stop(), broker.stop()]
    assert codes == [0, 0]
