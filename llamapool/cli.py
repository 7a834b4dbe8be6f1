"""The ``llamapool`` command.

Subcommands: ``up``, ``broker``, ``worker``, ``frontend``, ``make-test-model``,
``bench``, ``keygen``, ``exit-report``, ``probe``.

The broker, worker and frontend each build one frozen settings object
(``workers.broker.settings``, ``workers.model.settings``,
``frontend.settings``) from their flags and ``LLAMAPOOL_*`` variables: a
flag that is given wins over its variable, which wins over the default. The
tables of variables and defaults are in those modules' docstrings.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import logging
import os
import signal
import sys
from collections.abc import MutableMapping
from typing import Any

from frontend.settings import FrontendSettings
from llamapool import curve_cli, probe, sd_notify
from llamapool.exit_codes import ExitCode
from llamapool.signals import StopFlag, dump_stacks_on_sigusr1
from llamapool.supervisor import UP_QUEUE_FLAGS, UP_WORKER_FLAGS
from llamapool.test_model import QUANTS as TEST_MODEL_QUANTS
from protocol import tracing
from protocol.curve import CurveKeyError, client_keys
from protocol.settings import (
    ConfigError,
    add_flags,
    given_flags,
    load,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    to_env,
)
from workers.broker.settings import BrokerSettings, reject_removed
from workers.model.settings import ENGINES, WorkerSettings


def _setup_logging(level: str, fmt: str) -> None:
    from llamapool.log_format import configure_logging

    configure_logging(level, fmt)


def settings_for(args: argparse.Namespace) -> Any:
    """The settings of ``broker``, ``worker`` or ``frontend`` from flags and env.

    Raises:
        ConfigError: a required setting is missing or a variable is malformed.
    """
    cls = SETTINGS[args.command]
    if cls is BrokerSettings:
        reject_removed(os.environ, args.removed_authorized_dir)
    flags = given_flags(args, cls)
    if "api_keys" in flags:
        flags["api_keys"] = tuple(flags["api_keys"])
    if "aliases" in flags:
        flags["aliases"] = ",".join(flags["aliases"])  # a comma list too
    if "broker_endpoint" in flags:
        # --broker may be repeated; the setting is one comma list
        # (``protocol.broker_list``).
        flags["broker_endpoint"] = ",".join(flags["broker_endpoint"])
    return load(cls, os.environ, flags)


#: The settings class of each long-running subcommand.
SETTINGS = {"broker": BrokerSettings, "worker": WorkerSettings,
            "frontend": FrontendSettings}




def _gpu_list(text: str) -> list[str]:
    """``0,1``: device ids as CUDA_VISIBLE_DEVICES takes them."""
    ids = [part.strip() for part in text.split(",")]
    if not all(ids) or len(set(ids)) != len(ids):
        raise argparse.ArgumentTypeError(f"{text!r}: distinct ids, comma-separated")
    return ids


def _add_bench_parser(sub) -> None:
    bench = sub.add_parser(
        "bench", help="load-test an OpenAI-compatible server (streamed requests)",
        description="Streams requests at URL from --concurrency clients and "
                    "reports requests/s, output tokens/s, TTFT, inter-token and "
                    "end-to-end latency percentiles, HTTP statuses (503 apart) "
                    "and errors. Exits 0 even when requests failed.",
    )
    bench.add_argument("url", help="server base URL, with or without /v1")
    bench.add_argument("--concurrency", "-c", type=positive_int, default=1)
    amount = bench.add_mutually_exclusive_group()
    amount.add_argument("--requests", "-n", type=positive_int, default=None,
                        help="total requests to send (default 100)")
    amount.add_argument("--duration", type=positive_float, default=None,
                        help="send for this many seconds instead")
    bench.add_argument("--max-tokens", type=non_negative_int, default=64)
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
    bench.add_argument("--timeout", type=positive_float, default=600.0,
                       help="per-request timeout in seconds")
    bench.add_argument("--wait-after-503", type=non_negative_float, default=0.0,
                       metavar="S",
                       help="a refused client waits S seconds before its next "
                            "request (default 0: at once)")
    bench.add_argument("--json", action="store_true",
                       help="print the report as one JSON object on stdout")
    bench.add_argument("--no-progress", action="store_true",
                       help="no progress line on stderr (off anyway if not a tty)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llamapool", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default=os.environ.get("LLAMAPOOL_LOG_LEVEL",
                                                              "info"))
    parser.add_argument("--log-format", choices=["text", "json"],
                        default=os.environ.get("LLAMAPOOL_LOG_FORMAT", "text"),
                        help="json: one object per line (request logs included)")
    parser.add_argument(
        "--otlp-traces-endpoint", metavar="URL", default=None,
        help="export OpenTelemetry traces by OTLP/HTTP to URL (e.g. "
             "http://collector:4318/v1/traces), as vLLM's flag of that name; "
             "sets OTEL_EXPORTER_OTLP_TRACES_ENDPOINT for this process and "
             "those it starts (docs/operations.md, traces)")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="broker + N workers + gunicorn on this machine")
    up.add_argument("--model", help="GGUF path (default: Gemma 3 270M, assembled)")
    up.add_argument("--models", dest="models_file", metavar="FILE", default=None,
                    help="a TOML file of several models, one table each (path, "
                         "aliases, workers, ctx, chat_format, threads, "
                         "cache_ram, gpu_layers, repack, default): "
                         "docs/operations.md, several models")
    up.add_argument("--workers", type=positive_int, default=None,
                    help="worker processes (default: 2 of one slot each, or "
                         "1 of 2 batched slots on a CPU where batching pays: "
                         "llamapool/pool_shape.py)")
    up.add_argument("--slots-per-worker", type=positive_int, default=None,
                    help="slots in each worker, decoded as one batch "
                         "(the worker's --slots; default 1, or 2 as --workers says)")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8080)
    up.add_argument("--gpus", type=_gpu_list, default=None, metavar="0,1",
                    help="GPU ids: worker i sees only the (i mod N)-th "
                         "(CUDA_VISIBLE_DEVICES); with --gpu-layers")
    add_flags(up, FrontendSettings, ("api_keys", "api_key_file", "keys_file",
                                     "cache_scope",
                                     "cors_origins", "cors_methods", "cors_headers",
                                     "cors_credentials", "allowed_hosts"))
    add_flags(up, WorkerSettings, UP_WORKER_FLAGS)
    add_flags(up, BrokerSettings, UP_QUEUE_FLAGS)

    broker = sub.add_parser("broker", help="the broker alone")
    add_flags(broker, BrokerSettings)
    # Removed (keys have roles now); kept only to say so instead of
    # argparse's bare "unrecognized arguments".
    broker.add_argument("--curve-authorized-dir", dest="removed_authorized_dir",
                        default=None, help=argparse.SUPPRESS)

    worker = sub.add_parser("worker", help="one model worker")
    add_flags(worker, WorkerSettings)

    frontend = sub.add_parser("frontend", help="gunicorn on the Falcon app")
    frontend.add_argument("--bind",
                          default=os.environ.get("LLAMAPOOL_BIND", "127.0.0.1:8080"),
                          help="gunicorn's address (env LLAMAPOOL_BIND)")
    add_flags(frontend, FrontendSettings)

    model = sub.add_parser("make-test-model", help="write the tiny test GGUF")
    model.add_argument("path")
    model.add_argument("--tools-template", action="store_true",
                       help="a chat template that renders tools")
    model.add_argument("--tool-format", default=None,
                       choices=("hermes", "llama3", "mistral", "mistral-v11"),
                       help="a chat template that renders tools and teaches "
                            "this tool-call format")
    model.add_argument("--fim", action="store_true",
                       help="with fill-in-the-middle tokens (for /infill)")
    model.add_argument("--quant", choices=TEST_MODEL_QUANTS, default="f32",
                       help="the layers' weight type: q8_0 and q4_0 take "
                            "llama.cpp's quantized (repacked, AMX) kernels")
    model.add_argument("--reranker", nargs="?", const="template", default=None,
                       choices=("template", "plain"),
                       help="write a tiny reranker instead (pooling rank): "
                            "with a rerank template, or plain (BOS query doc)")
    report = sub.add_parser(
        "exit-report",
        help="a systemd unit's ExecStopPost: log how its process ended",
        description="Logs one line such as 'worker-1 killed by SIGSEGV during "
                    "job 3f2a' from systemd's EXIT_CODE and EXIT_STATUS and "
                    "the worker's phase file; silent after a clean exit.")
    report.add_argument("--name", default="worker", help="the name to log")
    report.add_argument("--phase-file",
                        default=os.environ.get("LLAMAPOOL_PHASE_FILE", ""),
                        help="the worker's phase file (env LLAMAPOOL_PHASE_FILE)")
    _add_bench_parser(sub)
    curve_cli.add_keygen_parser(sub)
    probe.add_probe_parser(sub)
    return parser


def _fail(log: logging.Logger, code: ExitCode, message: str, *args: Any) -> int:
    log.error(message, *args)
    return code


def _metrics_port_failure(log: logging.Logger, port: int, exc: OSError) -> int:
    """The ``/metrics`` port is in use (or not ours to bind): name it and
    exit with the bind code, before any socket to the pool is open."""
    return _fail(log, ExitCode.BIND, "cannot serve metrics on port %d: %s",
                 port, exc.strerror or exc)


def run_broker(args: argparse.Namespace) -> int:
    import zmq

    from workers.broker.broker import Broker
    from workers.broker.security import InsecureEndpoint

    log = logging.getLogger("llamapool.broker")
    try:
        settings = settings_for(args)
    except ConfigError as exc:
        return _fail(log, ExitCode.USAGE, "%s", exc)
    stop = StopFlag().install()
    metrics = None
    if settings.metrics_port:
        from workers.broker.metrics import serve_broker_metrics

        try:
            metrics = serve_broker_metrics(settings.metrics_port)
        except OSError as exc:
            return _metrics_port_failure(log, settings.metrics_port, exc)
    tracing.configure("broker")
    broker = Broker(settings, metrics=metrics, notifier=sd_notify.Notifier())
    try:
        broker.bind()
    except InsecureEndpoint as exc:
        return _fail(log, ExitCode.INSECURE, "%s", exc)
    except CurveKeyError as exc:
        return _fail(log, ExitCode.CURVE_KEYS, "%s", exc)
    except zmq.ZMQError as exc:
        return _fail(log, ExitCode.BIND, "cannot bind: %s", exc)
    broker.run(stop)
    return ExitCode.OK


def run_worker(args: argparse.Namespace) -> int:
    from workers.model.engines import load_engine
    from workers.model.worker import EngineLoadError, ModelWorker

    log = logging.getLogger("llamapool.worker")
    try:
        settings = settings_for(args)
    except ConfigError as exc:
        return _fail(log, ExitCode.USAGE, "%s", exc)
    if settings.engine not in ENGINES:
        return _fail(log, ExitCode.USAGE, "unknown engine %r; one of %s",
                     settings.engine, ", ".join(ENGINES))
    if settings.engine == "synthetic":
        log.info("synthetic engine at %g tokens/s: no model is loaded",
                 settings.tokens_per_second)
    elif not settings.model_path:
        return _fail(log, ExitCode.USAGE, "--model PATH (or LLAMAPOOL_MODEL) is "
                     "required with --engine llama.cpp (the default)")
    elif not os.path.isfile(settings.model_path):
        return _fail(log, ExitCode.MODEL_LOAD, "model file not found: %s",
                     settings.model_path)
    tracing.configure("worker")
    try:
        worker_class = ModelWorker
        if settings.n_slots > 1:  # one batched context, K slots in the ledger
            from workers.model.batched_worker import BatchedWorker as worker_class
        worker = worker_class(settings, lambda: load_engine(settings),
                              notifier=sd_notify.Notifier())
    except CurveKeyError as exc:
        return _fail(log, ExitCode.CURVE_KEYS, "%s", exc)
    except ConfigError as exc:  # e.g. a --slot-save-path it cannot create
        return _fail(log, ExitCode.USAGE, "%s", exc)
    stop = StopFlag().install()
    if settings.metrics_port:
        from workers.model.metrics import serve_worker_metrics

        try:
            serve_worker_metrics(worker, settings.metrics_port)
        except OSError as exc:
            return _metrics_port_failure(log, settings.metrics_port, exc)
    try:
        worker.run(stop)
    except EngineLoadError as exc:
        return _fail(log, ExitCode.MODEL_LOAD, "cannot load model %s: %s",
                     settings.model_path or settings.label, exc)
    return ExitCode.OK


def _absolute(path: str) -> str:
    return os.path.abspath(path) if path else ""


def run_frontend(args: argparse.Namespace) -> int:
    from frontend.auth import key_suffix
    from frontend.cors import bind_name
    from frontend.key_records import KeysFileError, read_keys_file
    from frontend.settings import read_key_file
    from frontend.vocabularies import Vocabularies
    from llamapool.serve import exec_gunicorn

    log = logging.getLogger("llamapool.frontend")
    try:
        settings = settings_for(args)
        keys = list(settings.api_keys)
        if settings.api_key_file:
            keys += read_key_file(settings.api_key_file)
        # Fail here, once, naming the entry, not in every gunicorn worker.
        named = read_keys_file(settings.keys_file) if settings.keys_file else ()
        Vocabularies(settings)  # the models file's tables (loads nothing)
    except (ConfigError, OSError, KeysFileError, UnicodeDecodeError) as exc:
        return _fail(log, ExitCode.USAGE, "%s", exc)
    if named:
        log.info("API keys required; %d named keys from %s", len(named),
                 settings.keys_file)
    elif keys:
        log.info("API keys required; first key ends in ...%s", key_suffix(keys[0]))
    else:
        log.warning("no API key set: every endpoint is open to local clients "
                    "(web pages only from the origins --cors-origins allows)")
    try:
        # Fail here, once, not in every gunicorn worker.
        client_keys(settings.curve_server_key, settings.curve_secret_key)
    except CurveKeyError as exc:
        return _fail(log, ExitCode.CURVE_KEYS, "%s", exc)
    # gunicorn's workers read the settings back from the environment
    # (``llamapool.wsgi``); file paths are made absolute for them.
    bind_host = bind_name(args.bind)
    settings = dataclasses.replace(
        settings,
        # The name it is bound by is a name it answers to (``frontend.cors``).
        allowed_hosts=settings.allowed_hosts
        if bind_host is None or settings.allowed_hosts == ("*",)
        else (*settings.allowed_hosts, bind_host),
        api_key_file=_absolute(settings.api_key_file),
        keys_file=_absolute(settings.keys_file),
        models_file=_absolute(settings.models_file),
        curve_server_key=_absolute(settings.curve_server_key),
        curve_secret_key=_absolute(settings.curve_secret_key),
    )
    exec_gunicorn({
        **os.environ,
        **to_env(settings),
        "LLAMAPOOL_BIND": args.bind,
        "LLAMAPOOL_LOG_LEVEL": args.log_level,
        "LLAMAPOOL_LOG_FORMAT": args.log_format,
        # gunicorn is exec'd: faulthandler, enabled here, would not survive.
        "PYTHONFAULTHANDLER": "1",
    })
    return ExitCode.OK  # not reached


def run_make_test_model(args: argparse.Namespace) -> int:
    from llamapool.test_model import write_test_model

    try:
        if args.reranker:
            from llamapool.test_reranker import write_test_reranker

            if args.tools_template or args.tool_format or args.fim:
                print("make-test-model: --reranker takes only --quant",
                      file=sys.stderr)
                return ExitCode.USAGE
            write_test_reranker(args.path, quant=args.quant,
                                rerank_template=args.reranker == "template")
            print(args.path)
            return ExitCode.OK
        from llamapool.test_model import (
            TOOL_FORMAT_CONTROL_PIECES,
            TOOL_FORMAT_TEMPLATES,
            TOOLS_CHAT_TEMPLATE,
        )

        template = ({"chat_template": TOOLS_CHAT_TEMPLATE} if args.tools_template
                    else {})
        if args.tool_format:
            template = {"chat_template": TOOL_FORMAT_TEMPLATES[args.tool_format],
                        "control_pieces": TOOL_FORMAT_CONTROL_PIECES.get(
                            args.tool_format, ())}
        write_test_model(args.path, fim=args.fim, quant=args.quant, **template)
    except ModuleNotFoundError as exc:
        print(f"llamapool make-test-model needs {exc.name}: "
              "pip install 'llamapool[test]'", file=sys.stderr)
        return ExitCode.USAGE
    print(args.path)
    return ExitCode.OK


def run_exit_report(args: argparse.Namespace) -> int:
    from protocol.worker_phase import describe_exit, read_phase

    log = logging.getLogger("llamapool.exit")
    # systemd's ExecStopPost environment: EXIT_CODE is exited, killed or
    # dumped; EXIT_STATUS the exit status or the signal's name ("SEGV").
    how, status = os.environ.get("EXIT_CODE", ""), os.environ.get("EXIT_STATUS", "")
    try:
        if how in ("killed", "dumped"):
            code = -signal.Signals[f"SIG{status}"].value
        elif how == "exited":
            code = int(status)
        else:
            return ExitCode.OK  # not run by systemd after a stop
    except (KeyError, ValueError):
        log.error("%s ended: %s %s", args.name, how, status)
        return ExitCode.OK
    if code != 0:
        log.error("%s %s", args.name, describe_exit(code, read_phase(args.phase_file)))
    return ExitCode.OK


def run_bench(args: argparse.Namespace) -> int:
    from llamapool import loadgen

    if args.prompt_file and not os.path.isfile(args.prompt_file):
        print(f"llamapool bench: no such prompt file: {args.prompt_file}",
              file=sys.stderr)
        return ExitCode.USAGE
    return loadgen.main(args)


def export_traces_to(endpoint: str | None, environ: MutableMapping[str, str]) -> None:
    """``--otlp-traces-endpoint``: the standard variable, set before any
    process of the pool reads it (``protocol.tracing.configure``), and
    inherited by what ``up`` starts and gunicorn's workers."""
    if endpoint:
        environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = endpoint


def main(argv: list[str] | None = None) -> int:
    # A native crash (SIGSEGV, SIGILL, SIGBUS, SIGFPE in llama.cpp) writes
    # every thread's Python stack to stderr, the log, before the process
    # dies of it; gunicorn's processes get it from PYTHONFAULTHANDLER
    # (``run_frontend``).
    faulthandler.enable(all_threads=True)
    args = build_parser().parse_args(argv)
    _setup_logging(args.log_level, args.log_format)
    export_traces_to(args.otlp_traces_endpoint, os.environ)
    if args.command == "up":
        from llamapool.supervisor import run_up

        return run_up(args)
    if args.command in ("broker", "worker"):
        dump_stacks_on_sigusr1()
    handlers = {
        "broker": run_broker,
        "worker": run_worker,
        "frontend": run_frontend,
        "make-test-model": run_make_test_model,
        "bench": run_bench,
        "exit-report": run_exit_report,
        "keygen": curve_cli.run_keygen,
        "probe": probe.run_probe,
    }
    return int(handlers[args.command](args))


if __name__ == "__main__":
    sys.exit(main())
