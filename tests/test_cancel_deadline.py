"""A worker stuck in native code (issue 29, item 1): the broker's deadline for
``cancelling``, the worker ending itself, ``up`` restarting it, and no
worker outliving ``up``.

The stuck job is a real one that never leaves a C call
(``LLAMAPOOL_TEST_HANG``, ``workers.model.crash_on_demand``: libc's
``pause()`` with SIGTERM blocked in that thread, so the link thread keeps
heartbeating, as it does through a llama.cpp decode, and Python's SIGTERM
handler never runs). Before the fix the slot stayed ``cancelling`` for good,
and a worker stuck like this survived ``kill -9`` of ``up``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq

from llamapool.exit_codes import NOT_RESTARTABLE, ExitCode
from protocol import messages
from protocol.errors import ErrorCode
from protocol.payloads import (
    ChatMessage,
    GenerationRequest,
    GpuPlacement,
    Timings,
    Usage,
)
from protocol.prefix import BLOCK_TOKENS, prefix_blocks
from protocol.worker_phase import CANCEL_TIMEOUT_EXIT, describe_exit
from tests.deploy.test_systemd_units import parse_unit, seconds, unit_file
from tests.pool import TEST_HEARTBEAT, BrokerProbe, Proc, cli, free_port, wait_until
from workers.model.active_job import Outgoing
from workers.model.settings import WorkerSettings
from workers.model.worker import ModelWorker
from workers.model.worker_link import RegistrationState, WorkerLink

#: Short, for tests: the default is 30 s (``protocol.timing``).
CANCEL_TIMEOUT_S = 2.0


def full_log(proc: Proc) -> str:
    return proc.log_path.read_text(errors="replace")


def children(pid: int) -> dict[int, str]:
    """The child processes of ``pid`` and their command lines."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    found = {}
    for child in out.stdout.split():
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                found[int(child)] = f.read().replace(b"\0", b" ").decode()
        except OSError:
            pass
    return found


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class FrontendPeer:
    """A frontend's DEALER, as ``frontend.broker_link`` speaks: HELLO, then
    jobs, read frame by frame."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.sock.send_multipart(messages.Hello(os.getpid(), "test").to_wire())

    def submit(self, job_id: str, request: GenerationRequest, **fields) -> None:
        self.sock.send_multipart(
            messages.Submit(job_id, request, **fields).to_wire())

    def send(self, msg: messages.Message) -> None:
        self.sock.send_multipart(msg.to_wire())

    def next(self, timeout_s: float, job_id: str) -> messages.Message | None:
        """The next message about ``job_id`` (heartbeats are skipped)."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(left * 1000):
                return None
            msg = messages.decode(self.sock.recv_multipart())
            if getattr(msg, "job_id", None) == job_id:
                return msg
        return None


def slot_states(probe: BrokerProbe) -> list[str]:
    snap = probe.status(timeout_s=1.0)
    return [s["state"] for s in snap["slots"]] if snap else []


@pytest.mark.stack
def test_a_worker_stuck_cancelling_is_dropped_and_ends_itself(tiny_model, tmp_path):
    """Broker and worker keep the same deadline: at ``--cancel-timeout-s``
    after the CANCEL the slot leaves the ledger (its frontend hears
    ``worker_unresponsive``, the log names the job), and the worker ends its
    own process with exit 8, the stuck thread with it."""
    frontends, workers = f"ipc://{tmp_path}/frontends", f"ipc://{tmp_path}/workers"
    # One variable, read by both (as a pool's shared environment file would).
    env = {**os.environ, "LLAMAPOOL_CANCEL_TIMEOUT_S": str(CANCEL_TIMEOUT_S)}
    broker = Proc("broker", cli("broker", "--frontends", frontends, "--workers",
                                workers, *TEST_HEARTBEAT), tmp_path, env=env)
    worker = Proc("worker", cli("worker", "--broker", workers, "--model",
                                str(tiny_model), "--threads", "1", "--ctx", "512",
                                *TEST_HEARTBEAT), tmp_path,
                  env={**env, "LLAMAPOOL_TEST_HANG": "job"})
    ctx = zmq.Context()
    probe = BrokerProbe(frontends, ctx=ctx)
    try:
        wait_until(lambda: slot_states(probe) == ["idle"], 60, "the worker to register")
        peer = FrontendPeer(ctx, frontends)
        job_id = uuid.uuid4().hex
        peer.submit(job_id, GenerationRequest("completion", "Hi", max_tokens=4),
                    request_id="req-stuck-1", key="abcd")
        assert isinstance(peer.next(10, job_id), messages.Accepted)
        # The job is in the C call (its phase file would say "job <id>").
        wait_until(lambda: "busy" in slot_states(probe), 10, "the job to start")
        peer.send(messages.Cancel(job_id))
        cancelled_at = time.monotonic()
        wait_until(lambda: slot_states(probe) == ["cancelling"], 5, "cancelling")

        answer = peer.next(CANCEL_TIMEOUT_S + 10, job_id)
        dropped_s = time.monotonic() - cancelled_at
        assert isinstance(answer, messages.Error), (answer, full_log(broker))
        assert answer.code == ErrorCode.WORKER_UNRESPONSIVE
        wait_until(lambda: slot_states(probe) == [], 5, "the slot to leave the ledger")
        assert CANCEL_TIMEOUT_S - 0.1 <= dropped_s < CANCEL_TIMEOUT_S + 3, dropped_s

        code = worker.popen.wait(timeout=CANCEL_TIMEOUT_S + 10)
        ended_s = time.monotonic() - cancelled_at
        assert code == CANCEL_TIMEOUT_EXIT == ExitCode.CANCEL_TIMEOUT, full_log(worker)
        assert ended_s < CANCEL_TIMEOUT_S + 5, ended_s
        assert f"job {job_id} was told to cancel" in full_log(worker)

        broker_log = full_log(broker)
        assert re.search(rf"worker lost \(cancelled [\d.]+s ago and not ended "
                         rf"\(--cancel-timeout-s 2\): stuck\) during job {job_id} "
                         rf"\(request req-stuck-1, key abcd\)", broker_log), broker_log
        snap = probe.status()
        assert snap["counters"]["worker_cancel_timeouts"] == 1
        assert snap["slots_total"] == snap["slots_free"] == 0
        print(f"\ncancelled job stuck in C: slot dropped at {dropped_s:.1f}s, "
              f"worker exited ({code}) at {ended_s:.1f}s after the CANCEL")
    finally:
        probe.close()
        ctx.destroy(linger=0)
        if worker.alive():
            worker.kill()
        broker.stop()


def _up(tiny_model: Path, tmp_path: Path, env: dict[str, str],
        *args: str) -> tuple[Proc, str]:
    """``llamapool up`` with one worker; ``env`` reaches every child."""
    port = free_port()
    up = Proc("up", cli("up", "--model", str(tiny_model), "--workers", "1",
                        "--port", str(port), "--threads", "1",
                        "--heartbeat-interval-s", "0.2", *args),
              tmp_path, env={**os.environ, **env})
    return up, f"http://127.0.0.1:{port}"


def _slots(url: str) -> list[dict] | None:
    try:
        return httpx.get(url + "/slots", timeout=2).json()
    except (httpx.TransportError, ValueError):
        return None


@pytest.mark.stack
def test_up_restarts_a_worker_that_ended_itself_for_a_stuck_cancel(tiny_model,
                                                                    tmp_path):
    """End to end, as in the issue: the frontend gives up on a job whose
    worker is stuck and sends CANCEL; at the deadline the slot is dropped,
    the worker exits 8, ``up`` starts a fresh one at once (no backoff, no
    crash counted), and the pool serves again."""
    flag = tmp_path / "hang-once"
    flag.touch()
    up, url = _up(tiny_model, tmp_path, {
        "LLAMAPOOL_TEST_HANG": f"once:{flag}",
        # The frontend's silence deadline mid-job (600 s by default): its
        # CANCEL is what starts the broker's deadline.
        "LLAMAPOOL_FRAME_TIMEOUT_S": "1",
        "LLAMAPOOL_CANCEL_TIMEOUT_S": str(CANCEL_TIMEOUT_S)})
    try:
        wait_until(lambda: "llamapool ready at" in up.log(), 60, "the ready line")
        (before,) = wait_until(lambda: _slots(url), 30, "/slots")
        started = time.monotonic()
        r = httpx.post(url + "/v1/completions", timeout=30,
                       json={"prompt": "Hi", "max_tokens": 4})
        assert r.status_code == 504, r.text  # the frontend's frame timeout
        assert not flag.exists()  # the hang happened
        gave_up_s = time.monotonic() - started

        def fresh_worker():
            slots = _slots(url)
            return (slots if slots and len(slots) == 1 and slots[0]["state"] == "idle"
                    and slots[0]["pid"] != before["pid"] else None)

        (after,) = wait_until(fresh_worker, 60, "a fresh worker in the slot")
        back_s = time.monotonic() - started
        assert not pid_alive(before["pid"])
        log = full_log(up)
        assert re.search(r"worker-0 \(pid \d+\) exited with 8 \(a cancelled job "
                         r"stuck in native code past --cancel-timeout-s\) during "
                         r"job \w+; restarting it now", log), log[-3000:]
        assert "held after" not in log and "restarting in" not in log
        r = httpx.post(url + "/v1/completions", timeout=30,
                       json={"prompt": "Hi", "max_tokens": 4})
        assert r.status_code == 200, r.text
        print(f"\nstuck cancel under up: 504 at {gave_up_s:.1f}s, fresh worker "
              f"serving at {back_s:.1f}s")
    finally:
        left = children(up.pid)
        try:
            code = up.stop()
        finally:
            for pid in left:  # a stuck worker that a failed run left behind
                if pid_alive(pid):
                    os.kill(pid, signal.SIGKILL)
    assert code == 0


@pytest.mark.stack
def test_no_worker_outlives_a_killed_up(tiny_model, tmp_path):
    """``kill -9`` of ``up`` while its worker is stuck in a C call: the
    worker's parent-death signal is SIGKILL, the one it cannot miss (before:
    SIGTERM, which a stuck worker never sees, and it ran on as an orphan)."""
    up, url = _up(tiny_model, tmp_path, {
        "LLAMAPOOL_TEST_HANG": "job", "LLAMAPOOL_FRAME_TIMEOUT_S": "60",
        # Far away: here the worker must die of its parent's death, not of
        # its own deadline.
        "LLAMAPOOL_CANCEL_TIMEOUT_S": "600"})
    everything: set[int] = set()
    client = threading.Thread(target=lambda: _ignore_errors(
        lambda: httpx.post(url + "/v1/completions", timeout=60,
                           json={"prompt": "Hi", "max_tokens": 4})), daemon=True)
    try:
        wait_until(lambda: "llamapool ready at" in up.log(), 60, "the ready line")
        client.start()
        (stuck,) = wait_until(
            lambda: (s := _slots(url)) and s[0]["state"] == "busy" and s, 30,
            "the job to be stuck in its worker")
        kids = children(up.pid)
        everything = set(kids) | {g for c in kids for g in children(c)}
        assert stuck["pid"] in kids
        os.kill(up.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        up.popen.wait()
        wait_until(lambda: not pid_alive(stuck["pid"]), 10,
                   "the stuck worker to die with up")
        gone_s = time.monotonic() - killed_at
        wait_until(lambda: not [p for p in everything if pid_alive(p)], 40,
                   "the broker and the frontend to stop too")
        print(f"\nkill -9 up: stuck worker gone in {gone_s:.2f}s")
    finally:
        for pid in everything:  # what a failed run left behind
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        up.log_file.close()
        client.join(timeout=70)


def _ignore_errors(call) -> None:
    try:
        call()
    except httpx.HTTPError:
        pass


# --- the unit tier: the deadline's settings and the units that kill ------------


def test_both_sides_share_the_deadline_and_up_hands_it_on():
    from llamapool.supervisor import UP_BROKER_FLAGS, UP_WORKER_FLAGS
    from workers.broker.settings import BrokerSettings

    assert (WorkerSettings.cancel_timeout_s
            == BrokerSettings.__dataclass_fields__["cancel_timeout_s"].default)
    assert "cancel_timeout_s" in UP_WORKER_FLAGS
    assert "cancel_timeout_s" in UP_BROKER_FLAGS
    # Restarted by systemd and by up: no unit prevents it.
    assert ExitCode.CANCEL_TIMEOUT not in NOT_RESTARTABLE["worker"]
    assert describe_exit(8, "job ab12") == (
        "exited with 8 (a cancelled job stuck in native code past "
        "--cancel-timeout-s) during job ab12")


def test_the_worker_unit_ends_a_stuck_worker_with_sigkill():
    """systemd: SIGTERM is never seen by a stuck worker, so the stop must end
    in SIGKILL for the unit's every process, after the shutdown grace."""
    svc = parse_unit(unit_file("llamapool-worker@1.service"))["Service"]
    assert svc["KillMode"] == ["control-group"]
    assert svc["SendSIGKILL"] == ["yes"]
    assert svc["Restart"] == ["on-failure"]
    assert seconds(svc["TimeoutStopSec"][0]) > WorkerSettings.shutdown_grace_s


class _LoadedEngine:
    model_name, n_ctx, name, repack = "m", 64, "synthetic", ""
    gpu = GpuPlacement()


def _registered_link(**settings) -> tuple[WorkerLink, list[messages.Message]]:
    """A worker's link in process: no socket; what it writes is recorded."""
    worker = ModelWorker(WorkerSettings(broker_endpoint="ipc://nobody",
                                        engine="synthetic", **settings),
                         _LoadedEngine)
    worker.engine = _LoadedEngine()
    link = worker.link
    link._stop = threading.Event()
    link._registration.state = RegistrationState.CONFIRMED
    written: list[messages.Message] = []
    link.connection.send = lambda msg, frames=None: written.append(msg)
    return link, written


class _Exited(Exception):
    pass


def test_the_link_ends_the_process_at_the_cancel_deadline(monkeypatch):
    def exit_(code):
        raise _Exited(code)

    monkeypatch.setattr("workers.model.worker_link.os._exit", exit_)
    link, _ = _registered_link(cancel_timeout_s=5.0)
    link.on_message(messages.Submit("j", GenerationRequest("completion", "hi")))
    job = link._job
    now = time.monotonic()
    link.on_tick(now + 100)  # never cancelled: a long job is no stuck one
    link.on_message(messages.Cancel("j"))
    assert job.should_stop()
    link.on_tick(time.monotonic() + 4.5)
    # Losing the broker cancels again: the clock runs from the first cancel.
    link.on_lost(1.0)
    link.on_tick(time.monotonic() + 4.5)
    with pytest.raises(_Exited) as exited:
        link.on_tick(time.monotonic() + 5.1)
    assert exited.value.args == (CANCEL_TIMEOUT_EXIT,)


def test_a_job_that_ends_after_its_cancel_stops_the_clock(monkeypatch):
    monkeypatch.setattr("workers.model.worker_link.os._exit",
                        lambda code: pytest.fail("exited"))
    link, _ = _registered_link(cancel_timeout_s=5.0)
    link.on_message(messages.Submit("j", GenerationRequest("completion", "hi")))
    job = link._job
    link.on_message(messages.Cancel("j"))
    assert link.forward(Outgoing(job, messages.Final(
        "j", "cancelled", Usage(1, 0, 1), Timings(1, 1.0, 0, 0.0))))
    link.on_tick(time.monotonic() + 60)
    link.on_message(messages.Submit("k", GenerationRequest("completion", "hi")))
    link.on_tick(time.monotonic() + 60)  # the next job's clock never started


def test_the_link_answers_a_submit_it_cannot_decode():
    link, written = _registered_link()
    body = messages.Submit("job-7", GenerationRequest(
        "chat", messages=[ChatMessage("user", "hi")])).to_body()
    body[1][2][0][0] = "wizard"
    frames = [messages.PROTOCOL_HEADER, messages.Submit.COMMAND,
              msgpack.packb(body)]
    with pytest.raises(messages.MalformedMessage) as error:
        messages.decode(frames)
    link.on_malformed(error.value, frames)
    (answer,) = written
    assert (answer.job_id, answer.code) == ("job-7", ErrorCode.UNREADABLE_JOB)
    assert "wizard" in answer.message
    # Nothing names a job: dropped, nothing answered.
    for garbage in ([messages.PROTOCOL_HEADER, messages.Submit.COMMAND, b"\xc1"],
                    messages.Heartbeat().to_wire()[:2] + [b"\x91\x05"]):
        link.on_malformed(messages.MalformedMessage("bad"), garbage)
    assert len(written) == 1


def test_claims_that_fail_stop_steering_and_kept_ones_restore_them():
    from workers.broker.cache_claims import ClaimTrust, claim_kept
    from workers.broker.ledger import Ledger

    assert claim_kept(4, 4 * BLOCK_TOKENS - 1)  # all but the last token
    assert claim_kept(4, 3 * BLOCK_TOKENS)  # a restore not worth a block
    assert not claim_kept(4, 3 * BLOCK_TOKENS - 1)
    assert not claim_kept(1, 0) and claim_kept(1, 1)

    ledger = Ledger(10.0)
    for name in (b"honest", b"liar"):
        ledger.register_worker(name, messages.Ready(name.decode(), "m", 512, 1,
                                                    "h"), 0.0)
    blocks = prefix_blocks(list(range(5 * BLOCK_TOKENS)))
    # The honest worker holds 4 of the prompt's 5 blocks; the liar claims 5.
    ledger.record_cache_report(ledger.workers[b"honest"],
                               messages.CacheReport([blocks[:4]]))
    ledger.record_cache_report(ledger.workers[b"liar"],
                               messages.CacheReport([blocks]))
    slot = ledger.assign("a", b"fe", 1.0, blocks)
    assert slot.identity == b"liar" and slot.shared_blocks_at_assign == 5
    assert ledger.jobs["a"].claimed_blocks == 5
    assert slot.claims.record(claim_kept(5, 0))  # one failure: distrusted
    ledger.finish("a", 2.0)
    slot = ledger.assign("b", b"fe", 3.0, blocks)
    assert slot.identity == b"honest" and slot.shared_blocks_at_assign == 4
    # Busy or not, a distrusted worker gets jobs as LRU gives them, and what
    # it claims for them is still measured.
    slot = ledger.assign("c", b"fe", 3.5, blocks)
    assert slot.identity == b"liar" and slot.shared_blocks_at_assign == 0
    assert ledger.jobs["c"].claimed_blocks == 5
    trust = ClaimTrust()
    for _ in range(10):
        trust.record(False)
    assert trust.score == 8 and not trust.trusted
    for kept in range(1, 6):
        trust.record(True)
        assert trust.trusted == (kept >= 5)
