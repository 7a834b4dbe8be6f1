"""Every exit code of every ``llamapool`` process, in one table.

Boot failures get named codes (gunicorn's ``WORKER_BOOT_ERROR``, dramatiq's
``RET_CONNECT``), so a supervisor can tell "try again later" from "this will
fail the same way every time". The systemd units' ``RestartPreventExitStatus=``
and ``llamapool up``'s restart loop both come from ``NOT_RESTARTABLE``; a test
keeps the units equal to it.
"""

from __future__ import annotations

import enum

from protocol.worker_phase import CANCEL_TIMEOUT_EXIT


class ExitCode(enum.IntEnum):
    OK = 0
    #: Bad flags or settings (argparse exits 2 too).
    USAGE = 2
    #: The model file is missing or llama.cpp could not load it.
    MODEL_LOAD = 3
    #: ``llamapool frontend`` found no gunicorn config.
    NO_CONFIG = 4
    #: An endpoint or the metrics port could not be bound (in use, or no
    #: such address yet).
    BIND = 5
    #: A non-loopback endpoint without CURVE (and no --insecure-plaintext).
    INSECURE = 6
    #: A CURVE key file or directory is missing or bad.
    CURVE_KEYS = 7
    #: A worker ended itself: a job it was told to cancel stayed stuck in
    #: native code past --cancel-timeout-s. Restarted at once, and not
    #: counted toward a crash loop's hold.
    CANCEL_TIMEOUT = CANCEL_TIMEOUT_EXIT
    #: A second SIGTERM/SIGINT ended the process at once.
    FORCED = 130


#: Per process: the exits that a restart would only repeat. A model that fails
#: to load (3) or a port in use (5) may be fixed by the time of the restart;
#: a typo in a flag or a missing key file will not.
NOT_RESTARTABLE: dict[str, frozenset[ExitCode]] = {
    "broker": frozenset({ExitCode.USAGE, ExitCode.INSECURE, ExitCode.CURVE_KEYS}),
    "worker": frozenset({ExitCode.USAGE, ExitCode.CURVE_KEYS}),
    "frontend": frozenset({ExitCode.USAGE, ExitCode.NO_CONFIG, ExitCode.CURVE_KEYS}),
}
