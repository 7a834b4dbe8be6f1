"""The pieces behind issue 27, in process: ``--repack`` on each kind of CPU,
the phase file a crashed worker leaves, ``exit-report``, the warm-up gate,
and a held worker in the ledger."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from protocol import messages
from protocol.worker_phase import PhaseFile, describe_exit, job_phase, read_phase
from workers.broker.ledger import FAILED, LOADING, Ledger
from workers.broker.pool_stats import PoolStats
from workers.model.settings import WorkerSettings
from workers.model.synthetic_engine import SyntheticEngine
from workers.model.weight_repack import cpu_flags, cpu_has_amx, repack_enabled
from workers.model.worker import EngineLoadError, ModelWorker

SAPPHIRE_RAPIDS = frozenset({"avx2", "avx512f", "amx_bf16", "amx_tile", "amx_int8"})
EPYC = frozenset({"avx2", "fma", "f16c"})


def test_repack_auto_is_off_only_where_the_amx_kernel_would_run():
    assert not repack_enabled("auto", SAPPHIRE_RAPIDS).enabled
    assert "AMX" in repack_enabled("auto", SAPPHIRE_RAPIDS).shown
    assert repack_enabled("auto", EPYC).enabled
    assert repack_enabled("auto", EPYC).shown == "on (auto: no AMX on this CPU)"
    # Forced either way, whatever the CPU.
    assert repack_enabled("on", SAPPHIRE_RAPIDS).enabled
    assert not repack_enabled("off", EPYC).enabled


def test_cpu_flags_come_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Intel Xeon\n"
                    "flags\t\t: fpu avx2 amx_tile amx_int8\n\nprocessor\t: 1\n")
    assert cpu_has_amx(cpu_flags(str(info)))
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_a_bad_repack_value_is_refused():
    with pytest.raises(ValueError, match="LLAMAPOOL_REPACK"):
        WorkerSettings(broker_endpoint="ipc:///tmp/x", repack="maybe")


def test_the_phase_file_holds_the_last_phase_whole(tmp_path):
    path = str(tmp_path / "phase")
    phases = PhaseFile(path)
    phases.set(job_phase("3f2a" * 32))  # a long one first
    phases.set("idle")  # a shorter one must not keep the long one's tail
    assert read_phase(path) == "idle"
    phases.set(job_phase("ab12"))
    assert read_phase(path) == "job ab12"
    phases.close()
    assert read_phase(str(tmp_path / "none")) == ""
    PhaseFile(None).set("idle")  # no file: records nothing, raises nothing


def test_describe_exit_names_the_signal_and_the_phase():
    assert describe_exit(-11, "warm-up") == "killed by SIGSEGV during warm-up"
    assert describe_exit(-4, "job ab12") == "killed by SIGILL during job ab12"
    assert describe_exit(3, "loading") == "exited with 3 during loading"
    assert describe_exit(-9) == "killed by SIGKILL"


def run_exit_report(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llamapool", "exit-report", *args],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=60)


@pytest.mark.stack
def test_exit_report_logs_what_systemd_saw(tmp_path):
    phase = tmp_path / "phase"
    PhaseFile(str(phase)).set(job_phase("ab12"))
    out = run_exit_report({"EXIT_CODE": "killed", "EXIT_STATUS": "SEGV"},
                          "--name", "worker-1", "--phase-file", str(phase))
    assert out.returncode == 0
    assert "worker-1 killed by SIGSEGV during job ab12" in out.stderr
    out = run_exit_report({"EXIT_CODE": "exited", "EXIT_STATUS": "0"},
                          "--phase-file", str(phase))
    assert out.returncode == 0 and "worker" not in out.stderr


class _BrokenEngine(SyntheticEngine):
    def warm_up(self) -> None:
        raise RuntimeError("ggml_compute_forward: unsupported op")


class _Stop:
    def __init__(self) -> None:
        self.flag = False

    def set(self) -> None:
        self.flag = True

    def is_set(self) -> bool:
        return self.flag

    def wait(self, timeout_s):
        return self.flag


def test_a_worker_whose_warm_up_fails_never_takes_a_job(tmp_path):
    settings = WorkerSettings(broker_endpoint=f"ipc://{tmp_path}/nobody",
                              phase_file=str(tmp_path / "phase"),
                              heartbeat_interval_s=0.05)
    worker = ModelWorker(settings, _BrokenEngine)
    with pytest.raises(EngineLoadError, match="the warm-up failed: ggml"):
        worker.run(_Stop())
    assert worker.engine is None  # so it never sent READY
    assert read_phase(settings.phase_file) == "warm-up"


def test_a_held_worker_is_shown_failed_and_is_no_slot():
    ledger = Ledger(peer_timeout_s=3.0)
    ledger.register_loading(b"a", messages.Loading(
        "h:1", "tiny", 1, "h", failure="worker-0 killed by SIGSEGV during warm-up"),
        0.0)
    ledger.register_loading(b"b", messages.Loading(
        "h:2", "tiny", 2, "h", failure="worker-1 held after 5 crashes", held=True),
        0.0)
    states = {w.identity: w.state for w in ledger.workers.values()}
    assert states == {b"a": LOADING, b"b": FAILED}
    assert ledger.live_slots() == 0 and ledger.assign("job", b"f", 0.0) is None
    snap = ledger.snapshot(0.0, {}, PoolStats().totals())
    assert [s.failure for s in snap.slots] == [
        "worker-0 killed by SIGSEGV during warm-up", "worker-1 held after 5 crashes"]


class _Exited:
    """A child process that has already exited with ``returncode``."""

    pid = 4242

    def __init__(self, returncode: int) -> None:
        self.returncode = returncode

    def poll(self) -> int:
        return self.returncode


def _run_child(exits: list[int]):
    """``llamapool up``'s supervision of one worker whose runs end with
    ``exits`` in turn, each as soon as it starts; returns the child."""
    from llamapool.supervisor import Child

    child = Child("worker-0", "worker", ["unused"])
    runs = iter(exits)

    def start() -> None:
        child.proc = _Exited(next(runs))
        child.started_at = now[0]

    child.start = start
    now = [0.0]
    child.start()
    while child.held is None and child.restarts < len(exits) - 1:
        child.check(now[0])
        now[0] += 40.0  # past any backoff, short of a healthy run
    child.check(now[0])  # the last run's exit
    return child


def test_up_holds_a_worker_after_five_crashes_in_a_row():
    child = _run_child([-11] * 5 + [0] * 5)
    assert child.held is not None and child.held.startswith(
        "worker-0 held after 5 crashes in a row; last: killed by SIGSEGV")
    assert child.env["LLAMAPOOL_HELD"] == "1"


def test_clean_exits_are_restarted_but_never_held():
    child = _run_child([0] * 12)
    assert child.held is None and child.crashes == 0
    assert "LLAMAPOOL_LAST_FAILURE" not in child.env
