"""``llamapool probe worker|broker``: an exec probe for processes with no API.

Brokers and workers serve no HTTP requests, only their own ``/metrics``
(``--metrics-port``). Its server runs in a thread of its own and answers
even when the loop that matters is stuck, so an answer alone proves little;
the probe reads what the loop last wrote:

* ``llamapool_broker_loop_beat_age_seconds``: the routing loop publishes
  its ledger once per heartbeat (``workers.broker.metrics``);
* ``llamapool_worker_link_beat_age_seconds``: the worker's broker link
  beats once per heartbeat, while it generates too
  (``workers.model.metrics``); ``llamapool_worker_loaded`` and
  ``llamapool_worker_registered`` say how far it got.

Exit 0 when the check holds, 1 when it does not (one line on stdout says
why: a kubelet keeps it in the pod's events), 2 for bad flags. The port
defaults to the one the process itself reads (``LLAMAPOOL_WORKER_METRICS_PORT``
or ``LLAMAPOOL_BROKER_METRICS_PORT``), so a probe in the same container
needs no flags beyond what it checks.
"""

from __future__ import annotations

import argparse
import os
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from llamapool.exit_codes import ExitCode
from protocol.settings import non_negative_int, positive_float

#: What a worker probe can require, each implying the ones before it.
WORKER_LEVELS = ("alive", "loaded", "registered")
#: The port variable of each role, as its settings read it.
PORT_VARIABLES = {"worker": "LLAMAPOOL_WORKER_METRICS_PORT",
                  "broker": "LLAMAPOOL_BROKER_METRICS_PORT"}
#: A probe failed: the check did not hold, or nothing answered.
NOT_OK = 1


class ProbeFailed(Exception):
    """The check did not hold; the message says which part."""


def add_probe_parser(sub) -> None:
    probe = sub.add_parser(
        "probe", help="exec probe: is this worker or broker alive (and ready)?",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    roles = probe.add_subparsers(dest="role", required=True)
    for role in ("worker", "broker"):
        parser = roles.add_parser(role)
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=non_negative_int,
                            default=_env_port(PORT_VARIABLES[role]),
                            help=f"its --metrics-port (default: "
                                 f"{PORT_VARIABLES[role]})")
        parser.add_argument("--timeout-s", type=positive_float, default=2.0)
        parser.add_argument("--max-beat-age-s", type=positive_float, default=30.0,
                            help="the loop must have beaten within this "
                                 "(default 30, the systemd units' WatchdogSec)")
    roles.choices["worker"].add_argument(
        "--require", choices=WORKER_LEVELS, default="alive",
        help="alive: the link thread beats; loaded: and the model is loaded; "
             "registered: and a broker holds it in its ledger (default alive)")
    roles.choices["broker"].add_argument(
        "--min-slots", type=non_negative_int, default=0,
        help="and at least this many loaded slots in its ledger (default 0)")


def _env_port(variable: str) -> int:
    value = os.environ.get(variable, "")
    return int(value) if value.isdigit() else 0


def read_metrics(host: str, port: int, timeout_s: float) -> dict[str, float]:
    """The samples of ``http://host:port/metrics`` by name, each summed over
    its labels (``llamapool_slots_registered`` has one sample per model)."""
    url = f"http://{host}:{port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as answer:
            text = answer.read().decode()
    except (OSError, urllib.error.URLError) as exc:
        raise ProbeFailed(f"{url}: {exc}") from None
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def _beat_fresh(values: dict[str, float], name: str, max_age_s: float) -> float:
    if name not in values:
        raise ProbeFailed(f"no {name} yet: the loop has not beaten")
    age = values[name]
    if age > max_age_s:
        raise ProbeFailed(f"{name} is {age:.1f} s (over {max_age_s:g} s): stuck")
    return age


def check_worker(values: dict[str, float], require: str,
                 max_beat_age_s: float) -> str:
    """What holds of a worker, or ``ProbeFailed``."""
    age = _beat_fresh(values, "llamapool_worker_link_beat_age_seconds",
                      max_beat_age_s)
    level = WORKER_LEVELS.index(require)
    if level >= 1 and values.get("llamapool_worker_loaded") != 1:
        raise ProbeFailed("the model is not loaded yet")
    if level >= 2 and values.get("llamapool_worker_registered") != 1:
        raise ProbeFailed("loaded, but no broker holds this worker")
    return f"worker {require}: link beat {age:.1f} s ago"


def check_broker(values: dict[str, float], min_slots: int,
                 max_beat_age_s: float) -> str:
    """What holds of a broker, or ``ProbeFailed``."""
    age = _beat_fresh(values, "llamapool_broker_loop_beat_age_seconds",
                      max_beat_age_s)
    slots = int(values.get("llamapool_slots_registered", 0))
    if slots < min_slots:
        raise ProbeFailed(f"{slots} loaded slots, fewer than {min_slots}")
    return f"broker alive: loop beat {age:.1f} s ago, {slots} loaded slots"


def run_probe(args: argparse.Namespace) -> int:
    """``llamapool probe``; returns the exit code."""
    if not args.port:
        print(f"llamapool probe {args.role}: --port or "
              f"{PORT_VARIABLES[args.role]} is required")
        return ExitCode.USAGE
    try:
        values = read_metrics(args.host, args.port, args.timeout_s)
        if args.role == "worker":
            line = check_worker(values, args.require, args.max_beat_age_s)
        else:
            line = check_broker(values, args.min_slots, args.max_beat_age_s)
    except ProbeFailed as exc:
        print(f"not ok: {exc}")
        return NOT_OK
    print(f"ok: {line}")
    return ExitCode.OK
