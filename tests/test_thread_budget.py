"""``workers.broker.thread_budget``: the busy workers of a host share its
pool cores; fixed ``--threads`` workers count but are not told."""

from __future__ import annotations

from protocol import messages
from workers.broker.ledger import Ledger
from workers.broker.thread_budget import budgets


def ledger_with(*workers: tuple[str, int]) -> Ledger:
    """(host, pool_cores) per worker; identities w0, w1, ..."""
    ledger = Ledger(peer_timeout_s=10)
    for i, (host, cores) in enumerate(workers):
        ready = messages.Ready(f"w{i}", "m", 512, 100 + i, host,
                               pool_cores=cores)
        ledger.register_worker(f"w{i}".encode(), ready, now=0.0)
    return ledger


def start(ledger: Ledger, n: int) -> None:
    for i in range(n):
        assert ledger.assign(f"job{i}", b"fe", now=1.0 + i) is not None


def test_a_lone_job_gets_every_core_and_two_share_them():
    ledger = ledger_with(("h", 2), ("h", 2))
    assert budgets(ledger.workers.values()) == {}  # nobody busy
    start(ledger, 1)
    assert list(budgets(ledger.workers.values()).values()) == [2]
    start_second = ledger.assign("job-b", b"fe", now=5.0)
    assert start_second is not None
    assert sorted(budgets(ledger.workers.values()).values()) == [1, 1]
    ledger.finish("job-b", now=6.0)
    assert list(budgets(ledger.workers.values()).values()) == [2]


def test_more_busy_workers_than_cores_get_one_each():
    ledger = ledger_with(("h", 2), ("h", 2), ("h", 2))
    start(ledger, 3)
    assert sorted(budgets(ledger.workers.values()).values()) == [1, 1, 1]


def test_the_remainder_goes_to_the_lowest_slots():
    ledger = ledger_with(("h", 4), ("h", 4), ("h", 4))
    start(ledger, 3)
    got = budgets(ledger.workers.values())
    by_slot = [got[w.identity] for w in sorted(ledger.workers.values(),
                                               key=lambda w: w.slot_id)]
    assert by_slot == [2, 1, 1]


def test_hosts_are_separate_and_fixed_workers_count_but_are_not_told():
    ledger = ledger_with(("a", 2), ("b", 2), ("a", 0))
    start(ledger, 3)
    got = budgets(ledger.workers.values())
    assert b"w2" not in got  # fixed --threads
    assert got[b"w0"] == 1  # shares host a with the fixed worker
    assert got[b"w1"] == 2  # alone on host b


def test_threads_out_of_range_is_malformed():
    import msgpack
    import pytest

    from protocol import limits
    from protocol.records import MalformedMessage

    assert messages.decode(messages.Threads(2, 9).to_wire()) == messages.Threads(2, 9)
    assert messages.decode(messages.ThreadsSet(1, 9).to_wire()) == messages.ThreadsSet(1, 9)
    for command in (messages.Threads.COMMAND, messages.ThreadsSet.COMMAND):
        with pytest.raises(MalformedMessage):  # no seq: an answer to nothing
            messages.decode([messages.PROTOCOL_HEADER, command, msgpack.packb([1])])
    for bad_seq in (-1, "3", 1.5, 2**53, None):
        for command in (messages.Threads.COMMAND, messages.ThreadsSet.COMMAND):
            frames = [messages.PROTOCOL_HEADER, command, msgpack.packb([1, bad_seq])]
            with pytest.raises(MalformedMessage):
                messages.decode(frames)
    for bad in (0, -1, limits.MAX_THREADS + 1, "2", 1.5):
        frames = [messages.PROTOCOL_HEADER, messages.Threads.COMMAND,
                  msgpack.packb([bad, 1])]
        with pytest.raises(MalformedMessage):
            messages.decode(frames)


def test_thread_settings_are_checked():
    import pytest

    from protocol.settings import ConfigError
    from workers.model.settings import WorkerSettings

    auto = WorkerSettings(broker_endpoint="ipc://x", n_threads="auto",
                          pool_cores=3)
    assert auto.auto_threads and auto.starting_threads == 3
    assert WorkerSettings(broker_endpoint="ipc://x", n_threads="2"
                          ).starting_threads == 2
    assert WorkerSettings(broker_endpoint="ipc://x").starting_threads is None
    for bad in ("two", "-1", "1.5", "99999"):
        with pytest.raises(ConfigError, match="LLAMAPOOL_THREADS"):
            WorkerSettings(broker_endpoint="ipc://x", n_threads=bad)
    with pytest.raises(ConfigError, match="LLAMAPOOL_POOL_CORES"):
        WorkerSettings(broker_endpoint="ipc://x", pool_cores=-2)
