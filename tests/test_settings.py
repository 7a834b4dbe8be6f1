"""One settings story per process: flags over ``LLAMAPOOL_*`` over defaults.

The documented tables are checked against the settings classes, and the
command's exit codes are checked through the real processes: a usage or key
error is reported with its named code, and ``llamapool up`` does not restart
a child that exited with one (its systemd unit would not either).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import typing

import pytest

from frontend import settings as frontend_settings
from llamapool import cli
from llamapool.exit_codes import ExitCode
from protocol import defaults
from protocol.settings import ConfigError, defaults_table, load, to_env
from tests.pool import Proc, free_port, wait_until
from tests.pool import cli as cli_argv
from workers.broker import settings as broker_settings
from workers.model import settings as worker_settings

MODULES = [
    (frontend_settings, frontend_settings.FrontendSettings),
    (broker_settings, broker_settings.BrokerSettings),
    (worker_settings, worker_settings.WorkerSettings),
]


@pytest.mark.parametrize("module, cls", MODULES, ids=lambda x: x.__name__)
def test_documented_table_is_the_real_one(module, cls):
    assert defaults_table(cls) in module.__doc__


@pytest.mark.parametrize("module, cls", MODULES, ids=lambda x: x.__name__)
def test_every_field_has_a_variable(module, cls):
    for field in dataclasses.fields(cls):
        assert field.metadata.get("env", "").startswith("LLAMAPOOL_"), field.name


def test_context_size_has_one_default():
    assert (worker_settings.WorkerSettings.n_ctx
            == frontend_settings.FrontendSettings.n_ctx == defaults.N_CTX)


def test_flag_wins_over_variable_which_wins_over_default(monkeypatch):
    monkeypatch.setenv("LLAMAPOOL_BROKER", "tcp://127.0.0.1:1")
    monkeypatch.setenv("LLAMAPOOL_CTX", "1024")
    monkeypatch.setenv("LLAMAPOOL_SHUTDOWN_GRACE_S", "7.5")
    args = cli.build_parser().parse_args(["worker", "--ctx", "512"])
    settings = cli.settings_for(args)
    assert settings.broker_endpoint == "tcp://127.0.0.1:1"  # variable
    assert settings.n_ctx == 512  # flag over variable
    assert settings.shutdown_grace_s == 7.5  # variable, parsed as float
    assert settings.stall_timeout_s == worker_settings.WorkerSettings.stall_timeout_s


def test_round_trip_through_the_environment():
    original = frontend_settings.FrontendSettings(
        broker_endpoint="ipc:///tmp/x", api_keys=("a", "b"), chat_format=None,
        n_ctx=4096, frame_timeout_s=2.5)
    again = load(frontend_settings.FrontendSettings, to_env(original))
    assert again == original


@pytest.mark.parametrize("env, message", [
    ({}, "LLAMAPOOL_FRONTENDS_ENDPOINT is not set"),
    ({"LLAMAPOOL_FRONTENDS_ENDPOINT": "ipc://a", "LLAMAPOOL_WORKERS_ENDPOINT":
      "ipc://b", "LLAMAPOOL_HEARTBEAT_LIVENESS": "three"}, "is not int"),
    ({"LLAMAPOOL_FRONTENDS_ENDPOINT": "ipc://a", "LLAMAPOOL_WORKERS_ENDPOINT":
      "ipc://b", "LLAMAPOOL_INSECURE_PLAINTEXT": "perhaps"}, "is not a boolean"),
])
def test_bad_settings_are_named(env, message):
    with pytest.raises(ConfigError, match=message):
        load(broker_settings.BrokerSettings, env)


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cli_argv(*args),
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


@pytest.mark.stack
def test_malformed_variable_exits_with_usage_code(tmp_path):
    done = _run("broker", "--frontends", f"ipc://{tmp_path}/f", "--workers",
                f"ipc://{tmp_path}/w", env={"LLAMAPOOL_HEARTBEAT_LIVENESS": "x"})
    assert done.returncode == ExitCode.USAGE
    assert "LLAMAPOOL_HEARTBEAT_LIVENESS='x' is not int" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.stack
@pytest.mark.parametrize("role", ["broker", "worker"])
def test_a_metrics_port_in_use_exits_with_the_bind_code(role, tmp_path):
    """Once a CI flake: a worker whose --metrics-port was taken died with a
    traceback (exit 1), and nothing said which port."""
    endpoints = {
        "broker": ("--frontends", f"ipc://{tmp_path}/f", "--workers", f"ipc://{tmp_path}/w"),
        "worker": ("--broker", f"ipc://{tmp_path}/w", "--engine", "synthetic"),
    }
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = _run(role, *endpoints[role], "--metrics-port", str(port))
    assert done.returncode == ExitCode.BIND
    assert f"cannot serve metrics on port {port}" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.stack
def test_worker_without_model_exits_with_usage_code():
    done = _run("worker", "--broker", "tcp://127.0.0.1:1",
                env={"LLAMAPOOL_MODEL": ""})
    assert done.returncode == ExitCode.USAGE
    assert "--model PATH" in done.stderr


@pytest.mark.stack
def test_up_does_not_restart_a_child_with_a_key_error(tiny_model, tmp_path):
    """A missing key file is not fixed by restarting: ``up`` stops, exit 7."""
    missing = str(tmp_path / "no-such.key_secret")
    up = Proc("up", cli_argv("up", "--model", str(tiny_model), "--workers", "1",
                             "--port", str(free_port())),
              tmp_path, env={**os.environ, "LLAMAPOOL_CURVE_SECRET_KEY": missing})
    try:
        wait_until(lambda: not up.alive(), 60, "llamapool up to give up")
    finally:
        code = up.stop()
    assert code == ExitCode.CURVE_KEYS
    log = up.log()
    assert "not restarting it" in log
    assert "restarting in" not in log


#: A value other than the default for each kind of flagged setting.
_OTHER = {int: 7, float: 2.5, str: "x"}


@pytest.mark.parametrize("command, cls", [
    ("worker", worker_settings.WorkerSettings),
    ("broker", broker_settings.BrokerSettings),
    ("frontend", frontend_settings.FrontendSettings),
])
def test_a_flag_is_declared_once_and_hands_its_value_on(command, cls):
    """Every flag comes from its setting's declaration (``setting(flag=)``):
    the command parses it into that field, and ``as_argv`` (what ``llamapool
    up`` hands a child) gives it back, for every flagged field."""
    from protocol.settings import as_argv

    fields = [f for f in dataclasses.fields(cls) if f.metadata.get("flag")]
    assert fields
    values = {}
    for f in fields:
        cli_opts = f.metadata["cli"]
        if "const" in cli_opts:
            values[f.name] = cli_opts["const"]
        elif "choices" in cli_opts:
            values[f.name] = cli_opts["choices"][-1]
        elif f.name == "n_threads":
            values[f.name] = "auto"
        elif cli_opts.get("action") == "append":
            values[f.name] = ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"] \
                if f.name == "broker_endpoint" else ["a", "b"]
        elif f.name == "cors_origins":
            values[f.name] = ("http://a.example", "http://b.example")
        elif f.name == "allowed_hosts":
            values[f.name] = ("pool.example", ".lan.example")
        elif f.name in ("cors_methods", "cors_headers"):
            values[f.name] = ("GET", "POST") if f.name == "cors_methods" \
                else ("Authorization", "X-Custom")
        elif f.default is None:  # an optional number: its annotation's kind
            hint = typing.get_type_hints(cls)[f.name]
            kind = next(a for a in typing.get_args(hint) if a is not type(None))
            values[f.name] = _OTHER.get(kind, "x")
        else:
            kind = type(f.default) if f.default is not dataclasses.MISSING else str
            values[f.name] = _OTHER.get(kind, "x")
    args = cli.build_parser().parse_args([command, *as_argv(cls, values)])
    assert {k: getattr(args, k) for k in values} == values
