"""gunicorn settings for the llamapool frontend (``llamapool frontend``).

Only gunicorn knobs live here; the app's own settings come from
``LLAMAPOOL_*`` variables (see ``frontend/settings.py``).

Never preload the app: each worker process must create its ZeroMQ context
after the fork.
"""

import os

bind = os.environ.get("LLAMAPOOL_BIND", "127.0.0.1:8080")

# gthread: one thread per in-flight request. A streamed response holds its
# thread for as long as the client reads, so threads bound the number of
# concurrent streams per process. Our subclass gives a thread only to a
# request whose head and body have arrived (read in the event loop, with
# LLAMAPOOL_HEADER_TIMEOUT_S / LLAMAPOOL_BODY_TIMEOUT_S), and ends a write the
# client does not take within LLAMAPOOL_SEND_TIMEOUT_S: slow clients hold no
# threads (llamapool/http_worker.py).
worker_class = "llamapool.http_worker.FullRequestThreadWorker"
workers = int(os.environ.get("LLAMAPOOL_FRONTEND_PROCESSES", "2"))
threads = int(os.environ.get("LLAMAPOOL_FRONTEND_THREADS", "64"))
preload_app = False

# Streams can be long; the worker-liveness timeout is unrelated to them
# (gthread workers notify the arbiter from their main loop).
timeout = 60
graceful_timeout = int(os.environ.get("LLAMAPOOL_GRACEFUL_TIMEOUT_S", "20"))
keepalive = 5
# Connections per process, of every kind: arriving requests (at most
# LLAMAPOOL_MAX_PENDING_CONNS, the oldest closed beyond), requests in threads
# and idle kept-alive ones. At this many the process stops accepting; the
# worker raises its open-files limit to fit (up to the hard limit).
worker_connections = int(os.environ.get("LLAMAPOOL_WORKER_CONNECTIONS", "4096"))

# Request logs come from the app (one structured line each); gunicorn's own
# error log goes to stderr.
accesslog = None
errorlog = "-"
loglevel = os.environ.get("LLAMAPOOL_LOG_LEVEL", "info")

# gunicorn's runtime control socket defaults to one fixed path per user, which
# several frontends on one host (tests, one per port) would fight over.
control_socket_disable = True


# --- Prometheus multiprocess mode --------------------------------------------
# PROMETHEUS_MULTIPROC_DIR is set before Python starts (by `llamapool
# frontend`, or the systemd unit). Stale files from an earlier run would be
# summed into this one's counters, so the directory is wiped at start, and a
# dead worker's live gauges are dropped when it exits.


def on_starting(server):
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if path:
        os.makedirs(path, exist_ok=True)
        for name in os.listdir(path):
            if name.endswith(".db"):
                os.remove(os.path.join(path, name))


def child_exit(server, worker):
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)


# --- systemd (Type=notify) ---------------------------------------------------
# gunicorn's arbiter sends READY=1 itself once it listens (Arbiter.start in
# gunicorn/arbiter.py). The watchdog pings come from a thread in the arbiter,
# and only while some worker has checked in within gunicorn's own `timeout`
# (the test the arbiter uses to kill a stuck worker): a frontend whose
# workers are all wedged stops pinging, and systemd restarts it.


def when_ready(server):
    import time

    from llamapool.sd_notify import Notifier

    def checked_in(worker) -> bool:
        try:  # the same test as Arbiter.murder_workers
            return time.monotonic() - worker.tmp.last_update() <= server.timeout
        except (OSError, ValueError):
            return False  # its heartbeat file is closing: it is exiting

    def serving() -> bool:
        return any(checked_in(w) for w in list(server.WORKERS.values()))

    Notifier().start_watchdog_thread(serving)


def post_worker_init(worker):
    # Connect to the broker and load the tokenizer now, not on the first request.
    warm_up = getattr(worker.wsgi, "warm_up", None)
    if warm_up is not None:
        warm_up()
