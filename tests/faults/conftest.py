"""The fault-injection suite: shared pool, figures, and the summary table.

Each scenario injects faults into real processes, then asserts that free
slots equal live workers and that no process is left behind. It records
figures into ``FAULT_REPORT``; the table is printed at the end of the run
(``make faults``, and ``make test``, which includes this suite).
"""

from __future__ import annotations

import dataclasses
import statistics

import pytest


@dataclasses.dataclass
class ScenarioFigures:
    name: str
    faults: int = 0
    leaked_slots: int = 0
    recovery_s: list[float] = dataclasses.field(default_factory=list)
    release_s: list[float] = dataclasses.field(default_factory=list)
    unexpected_failures: int = 0
    notes: str = ""


FAULT_REPORT: dict[str, ScenarioFigures] = {}


def figures(name: str) -> ScenarioFigures:
    return FAULT_REPORT.setdefault(name, ScenarioFigures(name))


def _p50_max(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values) * 1000:.0f} / {max(values) * 1000:.0f}"


def pytest_terminal_summary(terminalreporter):
    if not FAULT_REPORT:
        return
    tr = terminalreporter
    tr.section("fault injection figures")
    tr.write_line("| scenario | faults | slots leaked | pool whole again, ms p50 / max "
                  "| disconnect-to-release, ms p50 / max | other failures | notes |")
    tr.write_line("|---|---|---|---|---|---|---|")
    for f in FAULT_REPORT.values():
        tr.write_line(
            f"| {f.name} | {f.faults} | {f.leaked_slots} | {_p50_max(f.recovery_s)} "
            f"| {_p50_max(f.release_s)} | {f.unexpected_failures} | {f.notes} |"
        )


@pytest.fixture(scope="module")
def fault_pool(pool_factory):
    """Broker + 2 workers + gunicorn; scenarios may kill and replace parts
    (so it is private: nobody else is handed a pool the faults went through)."""
    with pool_factory(
            workers=2, private=True,
            # Long enough that a stream the tests pause on purpose (up to a
            # few seconds on a loaded machine before its fault is injected)
            # is still running when the fault comes; short enough for the
            # slow-reader scenario to see it end.
            worker_args=("--stall-timeout-s", "10")) as p:
        yield p
    assert all(not proc.alive() for proc in [p.broker, p.frontend, *p.workers]), \
        "a process was left behind"
