"""``llamapool bench``: a streaming load generator for OpenAI-compatible servers.

Drives any server that speaks ``/v1/completions`` or ``/v1/chat/completions``
with SSE (ours, llama.cpp's ``llama-server``, llama-cpp-python's server) from
``concurrency`` closed-loop clients, and reports throughput and latency
percentiles:

* TTFT: request sent to the first chunk that carries text;
* inter-token latency (ITL): gaps between successive text chunks;
* end-to-end latency: request sent to the end of the stream;
* output tokens: ``usage.completion_tokens`` when the server sends a usage
  chunk (``stream_options.include_usage``), else the number of text chunks.

A 503 is counted apart from other failures (it is admission control working,
not an error) and the client moves on to its next request, at once or after
``wait_after_503_s`` (a refused client that retries at once spins, and on a
small machine steals CPU from the server it measures). A stream
that ends with ``data: {"error": ...}`` or without ``[DONE]``/finish_reason is
a failure even though its HTTP status was 200.

Each client is a thread with one keep-alive ``http.client`` connection. The
load generator usually shares the machine with the server it measures, and
on a small one the CPU it spends per token is taken from that server: on 2
cores an ``httpx.AsyncClient`` spent about 1.2 ms of CPU per streamed token,
blocking ``http.client`` reads about 0.3 ms (BENCHMARKS.md section 14).
"""

from __future__ import annotations

import collections
import dataclasses
import http.client
import json
import math
import os
import ssl
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO
from urllib.parse import urlsplit

DEFAULT_PROMPT = "Write a short story about a llama who learns to fly."
#: The longest a client waits to connect (reads wait ``--timeout``).
CONNECT_TIMEOUT_S = 10.0
#: How often the progress line on stderr is redrawn.
PROGRESS_INTERVAL_S = 0.25


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """One load run. Exactly one of ``requests`` / ``duration_s`` bounds it."""

    base_url: str
    concurrency: int = 1
    requests: int | None = 100
    duration_s: float | None = None
    max_tokens: int = 64
    chat: bool = False
    prompt: str = DEFAULT_PROMPT
    api_key: str | None = None
    ignore_eos: bool = False
    model: str | None = None
    timeout_s: float = 600.0
    wait_after_503_s: float = 0.0

    @property
    def endpoint_url(self) -> str:
        path = "chat/completions" if self.chat else "completions"
        return f"{api_base(self.base_url)}/{path}"

    def body(self) -> dict:
        """The JSON body every request sends."""
        body: dict = {
            "max_tokens": self.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.chat:
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.model:
            body["model"] = self.model
        return body

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def api_base(url: str) -> str:
    """``http://h:p``, ``http://h:p/`` or ``http://h:p/v1`` -> ``http://h:p/v1``."""
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url + "/v1"


@dataclasses.dataclass
class RequestResult:
    """What one request saw."""

    status: int | None = None  # None: no HTTP response at all
    ok: bool = False
    ttft_s: float | None = None
    latency_s: float = 0.0
    inter_token_s: list[float] = dataclasses.field(default_factory=list)
    text_chunks: int = 0
    usage_tokens: int | None = None
    error: str | None = None  # a short kind, counted in the report

    @property
    def output_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.text_chunks


def _chunk_text(choice: dict) -> str:
    text = choice.get("text")
    if text is None:
        text = (choice.get("delta") or {}).get("content")
    return text or ""


def _error_kind(error: object) -> str:
    if isinstance(error, dict):
        code = error.get("code") or error.get("type") or "error"
        return f"stream error: {code}"
    return "stream error"


def _sse_lines(response: http.client.HTTPResponse) -> Iterator[str]:
    """The response body's lines, without their line ends (chunked or not:
    ``http.client`` undoes the transfer encoding)."""
    while True:
        line = response.readline()
        if not line:
            return
        yield line.decode("utf-8", "replace").rstrip("\r\n")


def _read_stream(lines: Iterator[str], result: RequestResult,
                 started: float) -> None:
    """Consume SSE events, filling in timings, tokens and how the stream ended."""
    last_text_at: float | None = None
    finished = False
    for line in lines:
        # llama.cpp's server has sent mid-stream errors as "error: {...}".
        is_error_line = line.startswith("error:")
        if not (line.startswith("data:") or is_error_line):
            continue  # blank separators, ": ping" comments, event names
        data = line.split(":", 1)[1].strip()
        if data == "[DONE]":
            finished = True
            break
        try:
            event = json.loads(data)
        except ValueError:
            result.error = "bad json in stream"
            return
        if is_error_line or (isinstance(event, dict) and "error" in event):
            err = event.get("error", event) if isinstance(event, dict) else event
            result.error = _error_kind(err)
            return
        if not isinstance(event, dict):
            continue
        usage = event.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            result.usage_tokens = usage["completion_tokens"]
        for choice in event.get("choices") or []:
            if _chunk_text(choice):
                now = time.perf_counter()
                if last_text_at is None:
                    result.ttft_s = now - started
                else:
                    result.inter_token_s.append(now - last_text_at)
                last_text_at = now
                result.text_chunks += 1
            if choice.get("finish_reason"):
                finished = True
    if finished:
        result.ok = True
    else:
        result.error = "stream ended early"


class Client:
    """One closed-loop client: a keep-alive connection, reopened after a
    failure (a stream broken off, a response not read to its end)."""

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        parts = urlsplit(config.endpoint_url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "localhost"
        self._port = parts.port
        self._path = parts.path + (f"?{parts.query}" if parts.query else "")
        self._body = json.dumps(config.body()).encode("utf-8")
        self._headers = {"Content-Type": "application/json", **config.headers()}
        self._conn: http.client.HTTPConnection | None = None

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            # Connecting gets at most 10 s; every read after, the timeout.
            connect_s = min(CONNECT_TIMEOUT_S, self.config.timeout_s)
            if self._https:
                conn = http.client.HTTPSConnection(
                    self._host, self._port, timeout=connect_s,
                    context=ssl.create_default_context())
            else:
                conn = http.client.HTTPConnection(self._host, self._port,
                                                  timeout=connect_s)
            conn.connect()
            conn.sock.settimeout(self.config.timeout_s)
            self._conn = conn
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _response(self) -> http.client.HTTPResponse:
        """Send the request; its response, once the status line is in.

        A kept-alive connection may have been closed by the server while it
        sat idle (gunicorn's ``keepalive``, 5 s in ``deploy``). If a reused
        connection fails before any byte of an answer, the request goes once
        more on a new connection, as common HTTP clients do; a new
        connection that fails so is an error.
        """
        while True:
            reused = self._conn is not None
            try:
                conn = self._connection()
                conn.request("POST", self._path, self._body, self._headers)
                return conn.getresponse()
            except (BrokenPipeError, ConnectionResetError,
                    http.client.RemoteDisconnected):
                self.close()
                if not reused:  # a fresh connection failed: a real error
                    raise

    def one_request(self) -> RequestResult:
        """Send one streamed request and time it."""
        result = RequestResult()
        started = time.perf_counter()
        try:
            response = self._response()
            result.status = response.status
            if response.status == 200:
                _read_stream(_sse_lines(response), result, started)
            if not result.error:
                response.read()  # the rest, so the connection can be reused
            if response.status not in (200, 503):
                result.error = f"http {response.status}"
            if result.error or response.will_close:
                self.close()
        except (OSError, http.client.HTTPException) as exc:
            result.error = type(exc).__name__
            self.close()
        result.latency_s = time.perf_counter() - started
        return result


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _ms_percentiles(values_s: list[float], qs: tuple[int, ...]) -> dict:
    out = {}
    for q in qs:
        value = percentile(values_s, q)
        out[f"p{q}"] = None if value is None else round(value * 1000, 3)
    return out


def summarize(config: BenchConfig, results: list[RequestResult],
              wall_s: float) -> dict:
    """The report as one JSON-ready dict."""
    done = [r for r in results if r.ok]
    rejected = sum(1 for r in results if r.status == 503)
    failed = [r for r in results if not r.ok and r.status != 503]
    tokens = sum(r.output_tokens for r in done)
    with_usage = sum(1 for r in done if r.usage_tokens is not None)
    source = ("none" if not done else "usage" if with_usage == len(done) else
              "chunks" if with_usage == 0 else "mixed")
    statuses = collections.Counter(
        "none" if r.status is None else str(r.status) for r in results
    )
    errors = collections.Counter(r.error for r in failed)
    itl = [gap for r in done for gap in r.inter_token_s]
    per_s = (lambda n: round(n / wall_s, 3)) if wall_s > 0 else (lambda n: 0.0)
    return {
        "url": config.endpoint_url,
        "concurrency": config.concurrency,
        "max_tokens": config.max_tokens,
        "ignore_eos": config.ignore_eos,
        "duration_s": round(wall_s, 3),
        "requests_sent": len(results),
        "requests_completed": len(done),
        "requests_rejected_503": rejected,
        "requests_failed": len(failed),
        "requests_per_s": per_s(len(done)),
        "rejections_per_s": per_s(rejected),
        "output_tokens": tokens,
        "output_tokens_per_s": per_s(tokens),
        "token_count_source": source,
        "ttft_ms": _ms_percentiles(
            [r.ttft_s for r in done if r.ttft_s is not None], (50, 90, 99)
        ),
        "itl_ms": _ms_percentiles(itl, (50, 99)),
        "latency_ms": _ms_percentiles([r.latency_s for r in done], (50, 90, 99)),
        "rejected_latency_ms": _ms_percentiles(
            [r.latency_s for r in results if r.status == 503], (50, 99)
        ),
        "status_counts": dict(sorted(statuses.items())),
        "errors": dict(errors.most_common()),
    }


class ProgressLine:
    """A one-line progress display redrawn with a carriage return."""

    def __init__(self, out: TextIO, total: int | None, duration_s: float | None):
        self.out = out
        self.total = total
        self.duration_s = duration_s
        self.started = time.perf_counter()

    def draw(self, results: list[RequestResult], final: bool = False) -> None:
        elapsed = time.perf_counter() - self.started
        ok = sum(1 for r in results if r.ok)
        rejected = sum(1 for r in results if r.status == 503)
        failed = len(results) - ok - rejected
        if self.total is not None:
            done = f"{len(results)}/{self.total}"
        else:
            done = f"{len(results)} in {min(elapsed, self.duration_s or 0):.0f}/" \
                   f"{self.duration_s:.0f}s"
        rate = ok / elapsed if elapsed > 0 else 0.0
        self.out.write(f"\r[{done}] ok {ok}  503 {rejected}  failed {failed}  "
                       f"{rate:.1f} req/s  {elapsed:.1f}s ")
        if final:
            self.out.write("\n")
        self.out.flush()


def run_bench(config: BenchConfig, progress: TextIO | None = None) -> dict:
    """Run the load and return the summary (see ``summarize``)."""
    return summarize(config, *run_requests(config, progress))


def run_requests(config: BenchConfig, progress: TextIO | None = None
                 ) -> tuple[list[RequestResult], float]:
    """Run the load: every request's result, and the wall time it took."""
    results: list[RequestResult] = []
    issued = 0
    turn_lock = threading.Lock()
    started = time.perf_counter()
    deadline = None if config.duration_s is None else started + config.duration_s

    def take_turn() -> bool:
        nonlocal issued
        with turn_lock:
            if config.requests is not None and issued >= config.requests:
                return False
            if deadline is not None and time.perf_counter() >= deadline:
                return False
            issued += 1
            return True

    def client_loop() -> None:
        client = Client(config)
        try:
            while take_turn():
                result = client.one_request()
                results.append(result)  # list.append is atomic
                if result.status == 503 and config.wait_after_503_s > 0:
                    time.sleep(config.wait_after_503_s)
        finally:
            client.close()

    threads = [threading.Thread(target=client_loop, name=f"bench-client-{i}",
                                daemon=True)
               for i in range(config.concurrency)]
    for thread in threads:
        thread.start()
    line = ProgressLine(progress, config.requests, config.duration_s) \
        if progress is not None else None
    for thread in threads:
        while thread.is_alive():
            thread.join(PROGRESS_INTERVAL_S)
            if line:
                line.draw(results)
    wall_s = time.perf_counter() - started
    if line:
        line.draw(results, final=True)
    return results, wall_s


def _fmt_ms(d: dict) -> str:
    return "  ".join(
        f"{k} {'-' if v is None else f'{v:.1f}'}" for k, v in d.items()
    )


def format_report(report: dict) -> str:
    """The summary as an aligned, human-readable block."""
    statuses = ", ".join(f"{k}: {v}" for k, v in report["status_counts"].items())
    errors = ", ".join(f"{k}: {v}" for k, v in report["errors"].items()) or "none"
    rows = [
        ("target", f"{report['url']} (concurrency {report['concurrency']}, "
                   f"max_tokens {report['max_tokens']})"),
        ("duration", f"{report['duration_s']:.2f} s"),
        ("requests", f"{report['requests_sent']} sent, "
                     f"{report['requests_completed']} completed, "
                     f"{report['requests_rejected_503']} rejected (503), "
                     f"{report['requests_failed']} failed"),
        ("requests/s", f"{report['requests_per_s']:.2f}"),
        ("503 rejections/s", f"{report['rejections_per_s']:.2f}"),
        ("output tokens/s", f"{report['output_tokens_per_s']:.1f} "
                            f"({report['output_tokens']} tokens, counted from "
                            f"{report['token_count_source']})"),
        ("TTFT ms", _fmt_ms(report["ttft_ms"])),
        ("inter-token ms", _fmt_ms(report["itl_ms"])),
        ("latency ms", _fmt_ms(report["latency_ms"])),
        ("503 answer ms", _fmt_ms(report["rejected_latency_ms"])),
        ("HTTP status", statuses or "none"),
        ("errors", errors),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def config_from_args(args) -> BenchConfig:
    """Build the config from ``llamapool bench`` flags (already range-checked)."""
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompt = f.read()
    else:
        prompt = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    requests = args.requests
    if requests is None and args.duration is None:
        requests = 100
    return BenchConfig(
        base_url=args.url,
        concurrency=args.concurrency,
        requests=requests,
        duration_s=args.duration,
        max_tokens=args.max_tokens,
        chat=args.chat,
        prompt=prompt,
        api_key=args.api_key or os.environ.get("LLAMAPOOL_API_KEY") or None,
        ignore_eos=args.ignore_eos,
        model=args.model,
        timeout_s=args.timeout,
        wait_after_503_s=args.wait_after_503,
    )


def main(args) -> int:
    """Entry point for ``llamapool bench``; 0 even when requests failed."""
    config = config_from_args(args)
    show_progress = not args.no_progress and sys.stderr.isatty()
    report = run_bench(config, sys.stderr if show_progress else None)
    if args.json:
        print(json.dumps(report))
    else:
        print(format_report(report))
    return 0
