"""gunicorn's gthread worker, giving threads only to requests that have arrived.

gthread hands every new connection to a thread, which then blocks reading the
request head and body with no deadline: a client sending one byte a second
holds a thread for as long as it likes, and ~64 such clients (slowloris) took
the whole frontend down. A thread was also held for as long as a client that
stopped reading kept its connection open, blocked writing a streamed body.

``FullRequestThreadWorker`` changes three things and keeps the rest of gthread
(keep-alive, graceful shutdown, error answers, the thread pool):

* **Requests are read in the event loop, non-blockingly, with deadlines.**
  A new connection, or a kept-alive one that turns readable, is buffered by
  the worker's main loop until its head and its body (up to one byte over
  the app's limit, ``RequestFraming``) are in; only then does a thread take
  it, and gunicorn's parser reads it from that buffer. The head must arrive
  within ``header_timeout_s`` and the body within ``body_timeout_s`` after
  it; a connection past its deadline gets 408 (or, if it sent nothing, is
  just closed). At most ``max_pending_connections`` connections per process
  may be in that state; beyond it the oldest is closed (slow senders are old,
  the requests of real clients arrive at once). Memory is bounded by that
  cap times the largest body held (``max_body_bytes``).
* **A socket handed to a thread times out** after ``send_timeout_s``: a
  write to a client that does not read raises ``TimeoutError``, gunicorn
  closes the response body (the lease ends as DISCONNECT and CANCEL frees the
  slot), and the connection is closed without lingering.
* **A graceful close lingers in the event loop.** gthread waited up to 2 s
  for the client's FIN on its main thread, so each client that kept a
  closed connection open froze the whole process for 2 s.

TLS, HTTP/2 and the PROXY protocol are left to plain gthread (the event loop
would see encrypted or binary bytes): terminate them at the load balancer.
"""

from __future__ import annotations

import errno
import resource
import selectors
import socket
import time
from collections.abc import Callable
from functools import partial

from gunicorn import http, util
from gunicorn.workers.gthread import TConn, ThreadWorker

from llamapool.request_framing import Progress, RequestFraming


def _plain_answer(status: str, message: str) -> bytes:
    body = (b'{"error": {"message": "%s", "type": "invalid_request_error"}}'
            % message.encode())
    return (b"HTTP/1.1 %s\r\nConnection: close\r\nContent-Type: application/json"
            b"\r\nContent-Length: %d\r\n\r\n%s" % (status.encode(), len(body), body))


#: Sent to a connection whose request did not arrive in time.
REQUEST_TIMEOUT_RESPONSE = _plain_answer(
    "408 Request Timeout", "the request did not arrive in time")
HEAD_TOO_LARGE_RESPONSE = _plain_answer(
    "431 Request Header Fields Too Large", "the request head is too large")
CONTINUE_RESPONSE = b"HTTP/1.1 100 Continue\r\n\r\n"

#: How often the event loop looks for requests past their deadline.
SWEEP_INTERVAL_S = 0.25
#: Warnings that come in floods (the cap, no descriptors) are logged at most
#: this often.
WARNING_INTERVAL_S = 10.0
#: After SIGTERM, requests still arriving get this long before they are closed.
STOP_LINGER_S = 2.0
#: How long a closing connection waits for the client's FIN (as gunicorn's
#: ``util.close_graceful``), so the kernel does not reset it while the last
#: response is still on its way.
CLOSE_LINGER_S = 2.0
#: File descriptors the process needs besides its connections.
SPARE_FDS = 256


class TimedConn(TConn):
    """A connection whose socket times out in its thread (reads and writes),
    and whose graceful close never blocks the event loop."""

    def __init__(self, cfg, sock, client, server, send_timeout_s: float,
                 linger: Callable[[socket.socket], None]) -> None:
        super().__init__(cfg, sock, client, server)
        self.send_timeout_s = send_timeout_s
        self.timed_out = False
        self._linger = linger

    def init(self) -> None:
        super().init()  # runs at every request; leaves the socket blocking
        self.sock.settimeout(self.send_timeout_s)

    def close(self, graceful: bool = False) -> None:
        # gthread closes gracefully from its event loop, waiting up to 2 s
        # for the client to close too (util.close_graceful): a client that
        # never does froze the whole process that long. The loop lingers
        # without blocking instead. A client that stopped reading gets no
        # graceful close at all.
        if graceful and not self.timed_out:
            self._linger(self.sock)
        else:
            super().close()


class ArrivingRequest:
    """A connection in the event loop whose request is still arriving."""

    __slots__ = ("buf", "deadline", "framing", "head_seen")

    def __init__(self, buf: bytes, deadline: float, framing: RequestFraming) -> None:
        self.buf = bytearray(buf)
        self.deadline = deadline
        self.framing = framing
        self.head_seen = False


class FullRequestThreadWorker(ThreadWorker):
    """gthread, with request reading moved out of the threads (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        #: Insertion order is age: the first entry is the oldest.
        self.arriving: dict[TimedConn, ArrivingRequest] = {}
        #: Sockets half-closed by us, waiting for the client's FIN: deadline.
        self.lingering: dict[socket.socket, float] = {}
        self._next_sweep = 0.0
        self._evicted = 0
        self._quiet_until: dict[str, float] = {}
        self._stop_by: float | None = None

    def run(self) -> None:
        s = self.wsgi.settings  # frontend.settings.FrontendSettings
        self.header_timeout_s = s.header_timeout_s
        self.body_timeout_s = s.body_timeout_s
        self.send_timeout_s = s.send_timeout_s
        self.max_body_bytes = s.max_body_bytes
        self.max_pending = s.max_pending_connections
        cfg = self.cfg
        # The same bound as gunicorn's parser (Message.max_buffer_headers).
        self.max_head_bytes = (cfg.limit_request_line + cfg.limit_request_fields
                               * (cfg.limit_request_field_size + 2) + 4)
        # Reading in the loop needs plain HTTP/1 bytes.
        self.read_in_loop = (not cfg.is_ssl and cfg.proxy_protocol == "off"
                             and cfg.http2_cleartext == "off")
        self._raise_fd_limit(self.worker_connections + SPARE_FDS)
        super().run()

    def _raise_fd_limit(self, wanted: int) -> None:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < wanted:
            new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
                soft = new
            except (OSError, ValueError):
                pass  # a sandbox forbids it: the warning below says so
        if soft != resource.RLIM_INFINITY and soft < wanted:
            self.log.warning("open files limit %d is below the %d connections "
                             "gunicorn may hold (worker_connections); raise it "
                             "(ulimit -n, LimitNOFILE=)", soft, wanted)

    # --- accepting ---------------------------------------------------------------

    def accept(self, listener) -> None:
        try:
            client_sock, client_addr = listener.accept()
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                # Out of descriptors: free one rather than die in the loop.
                self._warn_now_and_then("out of file descriptors (open files "
                                        "limit); closing the oldest arriving "
                                        "request")
                self._close_oldest_arriving()
            elif e.errno not in (errno.EAGAIN, errno.ECONNABORTED, errno.EWOULDBLOCK):
                raise
            return
        self.nr_conns += 1
        conn = TimedConn(self.cfg, client_sock, client_addr,
                         listener.getsockname(), self.send_timeout_s, self._linger)
        self.enqueue_req(conn)

    def enqueue_req(self, conn) -> None:
        """Start reading the connection's next request here; a thread gets it
        once it has arrived (gthread's callers all come through here)."""
        if not self.read_in_loop:
            super().enqueue_req(conn)
            return
        if len(self.arriving) >= self.max_pending:
            self._close_oldest_arriving()
            self._evicted += 1
            self._warn_now_and_then(
                "%d requests arriving at once (LLAMAPOOL_MAX_PENDING_CONNS): the "
                "oldest are closed, %d so far", self.max_pending, self._evicted)
        # Bytes a keep-alive connection already sent (pipelined) come first.
        held = conn.parser.unreader.take_buffered() if conn.parser else b""
        conn.sock.setblocking(False)
        framing = RequestFraming(self.max_head_bytes, self.max_body_bytes)
        arriving = ArrivingRequest(held, time.monotonic() + self.header_timeout_s,
                                   framing)
        self.arriving[conn] = arriving
        self.poller.register(conn.sock, selectors.EVENT_READ,
                             partial(self._on_readable, conn))
        if held:
            self._advance(conn, arriving)

    # --- reading -------------------------------------------------------------------

    def _on_readable(self, conn: TimedConn, _sock) -> None:
        arriving = self.arriving.get(conn)
        if arriving is None:
            return
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client went away before its request was complete
            self._close_arriving(conn)
            return
        arriving.buf += data
        self._advance(conn, arriving)

    def _advance(self, conn: TimedConn, arriving: ArrivingRequest) -> None:
        progress = arriving.framing.advance(arriving.buf)
        if progress is Progress.READY:
            self._hand_to_thread(conn, arriving)
        elif progress is Progress.HEAD_TOO_LARGE:
            self._close_arriving(conn, HEAD_TOO_LARGE_RESPONSE)
        elif progress is Progress.BODY and not arriving.head_seen:
            arriving.head_seen = True
            arriving.deadline = time.monotonic() + self.body_timeout_s
            if arriving.framing.expects_continue:
                # The client waits for this before it sends the body. gunicorn
                # sends another when the thread takes the request; HTTP allows
                # any number of 1xx answers.
                self._send_now(conn, CONTINUE_RESPONSE)

    def _hand_to_thread(self, conn: TimedConn, arriving: ArrivingRequest) -> None:
        del self.arriving[conn]
        self.poller.unregister(conn.sock)
        if conn.parser is None:  # a new connection (TConn.init keeps this one)
            conn.parser = http.get_parser(self.cfg, conn.sock, conn.client)
        conn.parser.unreader.unread(bytes(arriving.buf))
        conn.data_ready = True  # no waiting for data in the thread
        super().enqueue_req(conn)

    # --- closing -------------------------------------------------------------------

    def murder_pending(self) -> None:
        """Close requests past their deadline (run by gthread's loop)."""
        super().murder_pending()
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_INTERVAL_S
        if not self.alive and self._stop_by is None:
            self._stop_by = now + STOP_LINGER_S
        for conn, arriving in list(self.arriving.items()):
            deadline = arriving.deadline
            if self._stop_by is not None:
                deadline = min(deadline, self._stop_by)
            if deadline <= now:
                self._close_arriving(conn, REQUEST_TIMEOUT_RESPONSE
                                     if arriving.buf else None)
        for sock, deadline in list(self.lingering.items()):
            if deadline <= now:
                self._close_lingering(sock)

    def _linger(self, sock: socket.socket) -> None:
        """Send FIN, then close once the client has closed too (or in 2 s)."""
        try:
            sock.shutdown(socket.SHUT_WR)
            sock.setblocking(False)
            self.poller.register(sock, selectors.EVENT_READ, self._on_lingering)
        except (OSError, ValueError):
            util.close(sock)
            return
        self.lingering[sock] = time.monotonic() + CLOSE_LINGER_S

    def _on_lingering(self, sock: socket.socket) -> None:
        try:
            if sock.recv(65536):
                return  # discarded; the deadline bounds how long this goes on
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pass
        self._close_lingering(sock)

    def _close_lingering(self, sock: socket.socket) -> None:
        del self.lingering[sock]
        try:
            self.poller.unregister(sock)
        except (KeyError, ValueError, OSError):
            pass
        util.close(sock)

    def _close_oldest_arriving(self) -> None:
        if self.arriving:
            self._close_arriving(next(iter(self.arriving)))

    def _close_arriving(self, conn: TimedConn, answer: bytes | None = None) -> None:
        del self.arriving[conn]
        try:
            self.poller.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        if answer:
            self._send_now(conn, answer)
        self.nr_conns -= 1
        util.close(conn.sock)

    def _warn_now_and_then(self, message: str, *args) -> None:
        now = time.monotonic()
        if now >= self._quiet_until.get(message, 0.0):
            self._quiet_until[message] = now + WARNING_INTERVAL_S
            self.log.warning(message, *args)

    @staticmethod
    def _send_now(conn: TimedConn, data: bytes) -> None:
        """Best effort, never blocking: a short answer fits an empty buffer."""
        try:
            conn.sock.send(data)
        except OSError:
            pass

    # --- the send timeout ----------------------------------------------------------

    def handle_request(self, req, conn) -> bool:
        try:
            return super().handle_request(req, conn)
        except TimeoutError:
            # gunicorn has closed the response body already (its finally).
            conn.timed_out = True
            self.log.warning("client %s read nothing for %.0f s; response ended",
                             conn.client, self.send_timeout_s)
            return False
