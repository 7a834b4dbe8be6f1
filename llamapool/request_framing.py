"""Where one HTTP/1.1 request ends, judged from the bytes received so far.

The frontend's gunicorn worker (``llamapool.http_worker``) reads each request
in its event loop and gives it a thread only once it has fully arrived. It
needs to know when that is, and nothing more: it does not validate. Anything
it cannot frame (a malformed length, an unknown transfer coding, a garbage
chunk size) is handed over as it is, and gunicorn's parser answers it with
its usual 400; a body over the app's limit is handed over once one byte more
than the limit is held, so the app answers 413 without reading the socket.

Scanning is incremental: each call resumes where the last one stopped, so a
body arriving in many pieces (or as many tiny chunks) is scanned once.
"""

from __future__ import annotations

import enum

#: Longest chunk-size line (with extensions) or trailer section we wait for.
MAX_CHUNK_LINE_BYTES = 4096
MAX_TRAILER_BYTES = 8192

#: Chunk framing may at most this many times outweigh the data it carries
#: before the rest is left for the thread to read (one-byte chunks cost 6).
CHUNK_OVERHEAD_FACTOR = 8


class Progress(enum.Enum):
    HEAD = "waiting for the head"
    BODY = "waiting for the body"
    #: Complete, over a limit, or malformed: gunicorn and the app judge it.
    READY = "ready for a thread"
    #: No end of head within gunicorn's own header limits.
    HEAD_TOO_LARGE = "head too large"


class RequestFraming:
    """The framing state of one request: feed it the growing buffer.

    Args:
        max_head_bytes: longest head waited for (gunicorn's own limit).
        max_body_bytes: the app's body limit; one byte more is enough to
            hand the request over.
    """

    def __init__(self, max_head_bytes: int, max_body_bytes: int) -> None:
        self.max_head_bytes = max_head_bytes
        self.max_body_bytes = max_body_bytes
        self.head_end: int | None = None
        self.expects_continue = False
        self._searched = 0
        self._content_length: int | None = None
        self._chunked = False
        self._chunk_at = 0  # offset of the next chunk-size line
        self._decoded = 0  # chunk data bytes seen so far

    def advance(self, buf: bytes | bytearray) -> Progress:
        """How far the request in ``buf`` (everything received) has come."""
        if self.head_end is None:
            end = buf.find(b"\r\n\r\n", max(0, self._searched - 3))
            if end < 0:
                self._searched = len(buf)
                if len(buf) > self.max_head_bytes:
                    return Progress.HEAD_TOO_LARGE
                return Progress.HEAD
            self.head_end = end + 4
            if not self._read_head(bytes(buf[:end])):
                return Progress.READY
            self._chunk_at = self.head_end
        return self._body_progress(buf)

    # --- the head ------------------------------------------------------------------

    def _read_head(self, head: bytes) -> bool:
        """Find the body's framing. False: leave the head to gunicorn's parser."""
        # RFC 9112 section 2.2: one empty line may come before the request line.
        lines = head.removeprefix(b"\r\n").split(b"\r\n")
        http11 = lines[0].endswith(b"HTTP/1.1")
        lengths, codings = [], []
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                return False
            name, value = name.strip().lower(), value.strip()
            if name == b"content-length":
                lengths.append(value)
            elif name == b"transfer-encoding":
                codings += [c.strip().lower() for c in value.split(b",")]
            elif name == b"expect" and value.lower() == b"100-continue":
                self.expects_continue = http11
        if codings:
            if codings != [b"chunked"] or lengths:
                return False  # gunicorn refuses these (400 or 501)
            self._chunked = True
        elif lengths:
            if len(lengths) > 1 or not lengths[0].isdigit():
                return False
            self._content_length = int(lengths[0])
        return True

    # --- the body ------------------------------------------------------------------

    def _body_progress(self, buf: bytes | bytearray) -> Progress:
        received = len(buf) - self.head_end
        if self._chunked:
            return self._chunked_progress(buf)
        if self._content_length is None:
            return Progress.READY  # no body
        if received >= min(self._content_length, self.max_body_bytes + 1):
            return Progress.READY
        return Progress.BODY

    def _chunked_progress(self, buf: bytes | bytearray) -> Progress:
        raw_limit = CHUNK_OVERHEAD_FACTOR * self.max_body_bytes + 65536
        while True:
            if len(buf) - self.head_end > raw_limit:
                return Progress.READY
            line_end = buf.find(b"\r\n", self._chunk_at)
            if line_end < 0:
                if len(buf) - self._chunk_at > MAX_CHUNK_LINE_BYTES:
                    return Progress.READY
                return Progress.BODY
            size_text = bytes(buf[self._chunk_at:line_end]).split(b";")[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                return Progress.READY  # gunicorn's parser answers 400
            data_at = line_end + 2
            if size == 0:
                return self._trailers_progress(buf, data_at)
            held = min(size, len(buf) - data_at)  # this chunk's data so far
            if self._decoded + held > self.max_body_bytes:
                return Progress.READY  # over the limit: the app answers 413
            if len(buf) < data_at + size + 2:
                return Progress.BODY
            self._decoded += size
            self._chunk_at = data_at + size + 2

    @staticmethod
    def _trailers_progress(buf: bytes | bytearray, at: int) -> Progress:
        if buf[at:at + 2] == b"\r\n" or buf.find(b"\r\n\r\n", at) >= 0:
            return Progress.READY
        if len(buf) - at > MAX_TRAILER_BYTES:
            return Progress.READY
        return Progress.BODY
