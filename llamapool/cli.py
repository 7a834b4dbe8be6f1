"""The ``llamapool`` command.

Subcommands: ``up``, ``broker``, ``worker``, ``frontend``, ``make-test-model``,
``bench``, ``keygen``.
Each flag also has a ``LLAMAPOOL_*`` environment variable where noted.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from llamapool import curve_cli, sd_notify
from protocol import timing
from protocol.curve import CurveKeyError

#: Exit codes for boot failures (gunicorn/dramatiq style named codes).
EXIT_OK = 0
EXIT_USAGE = 2
EXIT_MODEL_LOAD = 3
EXIT_BIND = 5
EXIT_INSECURE = 6  # a non-loopback endpoint without CURVE
EXIT_CURVE_KEYS = 7  # a CURVE key file or directory is missing or bad


def _setup_logging(level: str, fmt: str) -> None:
    from llamapool.log_format import configure_logging

    configure_logging(level, fmt)


def _add_liveness_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--heartbeat-interval-s", type=float,
                   default=float(os.environ.get("LLAMAPOOL_HEARTBEAT_INTERVAL_S",
                                                timing.HEARTBEAT_INTERVAL_S)))
    p.add_argument("--heartbeat-liveness", type=int,
                   default=int(os.environ.get("LLAMAPOOL_HEARTBEAT_LIVENESS",
                                              timing.HEARTBEAT_LIVENESS)))


def _add_key_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", action="append", default=[],
                   help="accepted API key (repeatable); also LLAMAPOOL_API_KEYS")
    p.add_argument("--api-key-file", help="file with one API key per line")


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None,
                   help="llama.cpp threads per worker (default: cores / workers)")
    p.add_argument("--ctx", type=int, default=2048, help="context size per slot")
    p.add_argument("--chat-format", default=None,
                   help="named chat format (e.g. gemma), or 'template' for the "
                        "GGUF's Jinja template (default: template if present)")
    p.add_argument("--model-name", default=None,
                   help="name reported in /v1/models (default: file name)")


#: Engines a worker can run (``--engine``); llama.cpp is the only real one.
ENGINES = ("llama.cpp", "synthetic")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, not {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must not be negative, not {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, not {text}")
    return value


def _add_bench_parser(sub) -> None:
    bench = sub.add_parser(
        "bench", help="load-test an OpenAI-compatible server (streamed requests)",
        description="Streams requests at URL from --concurrency clients and "
                    "reports requests/s, output tokens/s, TTFT, inter-token and "
                    "end-to-end latency percentiles, HTTP statuses (503 apart) "
                    "and errors. Exits 0 even when requests failed.",
    )
    bench.add_argument("url", help="server base URL, with or without /v1")
    bench.add_argument("--concurrency", "-c", type=_positive_int, default=1)
    amount = bench.add_mutually_exclusive_group()
    amount.add_argument("--requests", "-n", type=_positive_int, default=None,
                        help="total requests to send (default 100)")
    amount.add_argument("--duration", type=_positive_float, default=None,
                        help="send for this many seconds instead")
    bench.add_argument("--max-tokens", type=_non_negative_int, default=64)
    bench.add_argument("--chat", action="store_true",
                       help="use /v1/chat/completions (default: /v1/completions)")
    prompt = bench.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=None, help="prompt text")
    prompt.add_argument("--prompt-file", default=None, help="read the prompt from F")
    bench.add_argument("--api-key", default=None,
                       help="bearer key (default: LLAMAPOOL_API_KEY)")
    bench.add_argument("--ignore-eos", action="store_true",
                       help="send ignore_eos, so every request runs to max_tokens")
    bench.add_argument("--model", default=None, help="the request's model field")
    bench.add_argument("--timeout", type=_positive_float, default=600.0,
                       help="per-request timeout in seconds")
    bench.add_argument("--wait-after-503", type=_non_negative_float, default=0.0,
                       metavar="S",
                       help="a refused client waits S seconds before its next "
                            "request (default 0: at once)")
    bench.add_argument("--json", action="store_true",
                       help="print the report as one JSON object on stdout")
    bench.add_argument("--no-progress", action="store_true",
                       help="no progress line on stderr (off anyway if not a tty)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llamapool", description=__doc__)
    parser.add_argument("--log-level", default=os.environ.get("LLAMAPOOL_LOG_LEVEL",
                                                              "info"))
    parser.add_argument("--log-format", choices=["text", "json"],
                        default=os.environ.get("LLAMAPOOL_LOG_FORMAT", "text"),
                        help="json: one object per line (request logs included)")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="broker + N workers + gunicorn on this machine")
    up.add_argument("--model", help="GGUF path (default: Gemma 3 270M, assembled)")
    up.add_argument("--workers", type=int, default=2)
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8080)
    _add_key_flags(up)
    _add_model_flags(up)
    _add_liveness_flags(up)

    broker = sub.add_parser("broker", help="the broker alone")
    broker.add_argument("--frontends", required=True,
                        help="endpoint to bind for frontends")
    broker.add_argument("--workers", required=True, help="endpoint to bind for workers")
    broker.add_argument("--metrics-port", type=int, default=None,
                        help="serve the broker's own /metrics on this port")
    _add_liveness_flags(broker)
    curve_cli.add_server_flags(broker)

    worker = sub.add_parser("worker", help="one model worker")
    worker.add_argument("--broker", required=True, help="broker workers endpoint")
    worker.add_argument("--model", default=None,
                        help="GGUF path (required with --engine llama.cpp)")
    worker.add_argument("--engine", choices=ENGINES, default="llama.cpp",
                        help="llama.cpp, or synthetic: a stand-in with no model "
                             "that emits 'tok0 tok1 ...' at --tokens-per-second")
    worker.add_argument("--tokens-per-second", type=_positive_float, default=50.0,
                        help="output rate of the synthetic engine")
    worker.add_argument("--stall-timeout-s", type=float, default=timing.STALL_TIMEOUT_S)
    worker.add_argument("--shutdown-grace-s", type=float, default=30.0)
    worker.add_argument("--metrics-port", type=int, default=None,
                        help="serve the worker's own /metrics on this port")
    _add_model_flags(worker)
    _add_liveness_flags(worker)
    curve_cli.add_client_flags(worker)

    frontend = sub.add_parser("frontend", help="gunicorn on the Falcon app")
    frontend.add_argument("--broker", required=True, help="broker frontends endpoint")
    frontend.add_argument("--bind", default="127.0.0.1:8080")
    frontend.add_argument("--model", default=None,
                          help="GGUF to count prompt tokens at the door (vocab only)")
    frontend.add_argument("--chat-format", default=None,
                          help="the workers' chat format (with --model)")
    frontend.add_argument("--ctx", type=int, default=2048,
                          help="the workers' context size (with --model)")
    _add_key_flags(frontend)
    _add_liveness_flags(frontend)
    curve_cli.add_client_flags(frontend)

    model = sub.add_parser("make-test-model", help="write the tiny test GGUF")
    model.add_argument("path")
    _add_bench_parser(sub)
    curve_cli.add_keygen_parser(sub)
    return parser


def run_broker(args: argparse.Namespace) -> int:
    import zmq

    from llamapool.signals import StopFlag
    from workers.broker.broker import Broker, BrokerSettings
    from workers.broker.security import InsecureEndpoint

    stop = StopFlag().install()
    metrics = None
    if args.metrics_port:
        from workers.broker.metrics import serve_broker_metrics

        metrics = serve_broker_metrics(args.metrics_port)
    broker = Broker(BrokerSettings(
        frontends_endpoint=args.frontends,
        workers_endpoint=args.workers,
        heartbeat_interval_s=args.heartbeat_interval_s,
        heartbeat_liveness=args.heartbeat_liveness,
        curve_secret_key=args.curve_secret_key,
        curve_authorized_dir=args.curve_authorized_dir,
        insecure_plaintext=args.insecure_plaintext,
    ), metrics=metrics, notifier=sd_notify.Notifier())
    try:
        broker.bind()
    except InsecureEndpoint as exc:
        logging.getLogger("llamapool.broker").error("%s", exc)
        return EXIT_INSECURE
    except CurveKeyError as exc:
        logging.getLogger("llamapool.broker").error("%s", exc)
        return EXIT_CURVE_KEYS
    except zmq.ZMQError as exc:
        logging.getLogger("llamapool.broker").error("cannot bind: %s", exc)
        return EXIT_BIND
    broker.run(stop)
    return EXIT_OK


def run_worker(args: argparse.Namespace) -> int:
    from llamapool.signals import StopFlag
    from workers.model.worker import EngineLoadError, ModelWorker, WorkerSettings

    log = logging.getLogger("llamapool.worker")
    if args.engine == "synthetic":
        from workers.model.synthetic_engine import SyntheticEngine

        def load_engine() -> SyntheticEngine:
            return SyntheticEngine(tokens_per_second=args.tokens_per_second,
                                   n_ctx=args.ctx, model_name=args.model_name)

        label = args.model_name or SyntheticEngine.name
        log.info("synthetic engine at %g tokens/s: no model is loaded",
                 args.tokens_per_second)
    else:
        if args.model is None:
            print("llamapool worker: --model PATH is required with --engine "
                  "llama.cpp (the default)", file=sys.stderr)
            return EXIT_USAGE
        if not os.path.isfile(args.model):
            log.error("model file not found: %s", args.model)
            return EXIT_MODEL_LOAD
        from workers.model.llama_engine import LlamaEngine

        def load_engine() -> LlamaEngine:
            return LlamaEngine(
                args.model, n_ctx=args.ctx, n_threads=args.threads,
                chat_format=args.chat_format, model_name=args.model_name,
            )

        label = args.model_name or os.path.basename(args.model)
    try:
        curve_keys = curve_cli.client_keys_from(args)
    except CurveKeyError as exc:
        log.error("%s", exc)
        return EXIT_CURVE_KEYS
    stop = StopFlag().install()
    worker = ModelWorker(WorkerSettings(
        broker_endpoint=args.broker,
        heartbeat_interval_s=args.heartbeat_interval_s,
        heartbeat_liveness=args.heartbeat_liveness,
        stall_timeout_s=args.stall_timeout_s,
        shutdown_grace_s=args.shutdown_grace_s,
        curve=curve_keys,
    ), load_engine, label, notifier=sd_notify.Notifier())
    if args.metrics_port:
        from workers.model.metrics import serve_worker_metrics

        serve_worker_metrics(worker, args.metrics_port)
    try:
        worker.run(stop)
    except EngineLoadError as exc:
        log.error("cannot load model %s: %s", args.model or label, exc)
        return EXIT_MODEL_LOAD
    return EXIT_OK


def api_keys_from(args: argparse.Namespace) -> list[str]:
    keys = list(args.api_key)
    keys += [k.strip() for k in os.environ.get("LLAMAPOOL_API_KEYS", "").split(",")]
    return [k for k in keys if k]


def run_frontend(args: argparse.Namespace) -> int:
    from frontend.auth import key_suffix
    from frontend.settings import read_key_file
    from llamapool.serve import exec_gunicorn, frontend_env

    keys = api_keys_from(args)
    shown = keys or (read_key_file(args.api_key_file) if args.api_key_file else [])
    log = logging.getLogger("llamapool.frontend")
    if shown:
        log.info("API keys required; first key ends in ...%s", key_suffix(shown[0]))
    else:
        log.warning("no API key set: every endpoint is open")
    try:
        curve_cli.client_keys_from(args)  # fail here, not in every gunicorn worker
    except CurveKeyError as exc:
        log.error("%s", exc)
        return EXIT_CURVE_KEYS
    exec_gunicorn(frontend_env(
        args.broker, args.bind, keys, args.api_key_file,
        {"LLAMAPOOL_HEARTBEAT_INTERVAL_S": str(args.heartbeat_interval_s),
         "LLAMAPOOL_HEARTBEAT_LIVENESS": str(args.heartbeat_liveness),
         "LLAMAPOOL_TOKENIZER_MODEL": args.model or "",
         "LLAMAPOOL_CHAT_FORMAT": args.chat_format or "",
         "LLAMAPOOL_CTX": str(args.ctx),
         "LLAMAPOOL_LOG_LEVEL": args.log_level,
         "LLAMAPOOL_LOG_FORMAT": args.log_format,
         **curve_cli.client_key_env(args)},
    ))
    return EXIT_OK  # not reached


def run_make_test_model(args: argparse.Namespace) -> int:
    from llamapool.test_model import write_test_model

    write_test_model(args.path)
    print(args.path)
    return EXIT_OK


def run_bench(args: argparse.Namespace) -> int:
    try:
        from llamapool import loadgen
    except ImportError as exc:
        print(f"llamapool bench needs httpx ({exc}); pip install httpx",
              file=sys.stderr)
        return EXIT_USAGE
    if args.prompt_file and not os.path.isfile(args.prompt_file):
        print(f"llamapool bench: no such prompt file: {args.prompt_file}",
              file=sys.stderr)
        return EXIT_USAGE
    return loadgen.main(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.log_level, args.log_format)
    if args.command == "up":
        from llamapool.supervisor import run_up

        return run_up(args)
    handlers = {
        "broker": run_broker,
        "worker": run_worker,
        "frontend": run_frontend,
        "make-test-model": run_make_test_model,
        "bench": run_bench,
        "keygen": curve_cli.run_keygen,
    }
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
