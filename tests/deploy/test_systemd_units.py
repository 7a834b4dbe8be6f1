"""The shipped systemd units: verified by systemd itself, and held to our rules.

``systemd-analyze verify`` checks syntax, dependencies and that every
``Exec*`` binary exists, so the units are copied to a temporary unit
directory with ``ExecStart`` pointing at this checkout's ``llamapool``.
Their command lines, expanded with the shipped example environment files,
must parse with the real CLI.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llamapool import cli
from llamapool.exit_codes import NOT_RESTARTABLE
from tests.system_tools import require_tool
from workers.broker.security import BrokerSecurity
from workers.model.settings import WorkerSettings

UNIT_DIR = Path(__file__).resolve().parents[2] / "deploy" / "systemd"
INSTALLED_BIN = "/opt/llamapool/venv/bin/llamapool"
LLAMAPOOL_BIN = Path(sys.executable).parent / "llamapool"
SERVICES = {
    "llamapool-broker.service": "broker.env.example",
    "llamapool-worker@1.service": "worker.env.example",
    "llamapool-frontend.service": "frontend.env.example",
}


def unit_file(name: str) -> Path:
    """The shipped file for a unit name (instances come from their template)."""
    return UNIT_DIR / re.sub(r"@[^.]+\.", "@.", name)


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """Sections of a unit file: key -> every value given (continuations joined)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key, []).append(value)
    return sections


def read_env(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


def expand(command: str, env: dict[str, str]) -> list[str]:
    """systemd's rules: ``${X}`` is one word, a lone ``$X`` splits on spaces."""
    argv = []
    for word in command.split():
        lone = re.fullmatch(r"\$(\w+)", word)
        if lone:
            argv += env.get(lone.group(1), "").split()
        else:
            argv.append(re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), ""), word))
    return argv


def seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)(min|s)?", value)
    assert match, value
    return int(match.group(1)) * (60 if match.group(2) == "min" else 1)


@pytest.fixture(scope="module")
def unit_path(tmp_path_factory) -> Path:
    """The units as installed, but running this checkout's ``llamapool``."""
    assert LLAMAPOOL_BIN.exists(), LLAMAPOOL_BIN
    root = tmp_path_factory.mktemp("units")
    for src in UNIT_DIR.iterdir():
        if src.suffix in (".service", ".target"):
            text = src.read_text().replace(INSTALLED_BIN, str(LLAMAPOOL_BIN))
            (root / src.name).write_text(text)
    return root


def analyze(unit_path: Path, *args: str) -> subprocess.CompletedProcess:
    tool = require_tool("systemd-analyze")  # .ci/run installs the systemd package
    # The trailing colon keeps the system's unit directories (network-online.target).
    env = {"SYSTEMD_UNIT_PATH": f"{unit_path}:", "PATH": "/usr/bin:/bin"}
    return subprocess.run([tool, *args], env=env, cwd=unit_path,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.stack
@pytest.mark.parametrize("unit", [*SERVICES, "llamapool.target"])
def test_systemd_analyze_verify(unit_path, unit):
    result = analyze(unit_path, "verify", unit)
    ours = [line for line in result.stderr.splitlines() if "llamapool" in line]
    assert result.returncode == 0 and not ours, result.stderr


@pytest.mark.stack
def test_verify_does_check_the_binary(tmp_path):
    """Without the path rewrite verify fails: the check above is not vacuous."""
    shutil.copy(UNIT_DIR / "llamapool-broker.service", tmp_path)
    result = analyze(tmp_path, "verify", "llamapool-broker.service")
    if Path(INSTALLED_BIN).exists():
        pytest.skip(f"{INSTALLED_BIN} exists on this machine")
    assert result.returncode != 0 and "not executable" in result.stderr


@pytest.mark.stack
@pytest.mark.parametrize("unit", list(SERVICES))
def test_hardening_exposure_is_low(unit_path, unit):
    # systemd's scale is 0-100 here (1.5 printed as "1.5 OK"); 2.0 and below
    # is its "OK" band.
    result = analyze(unit_path, "security", "--offline=true", "--threshold=20",
                     "--no-pager", unit)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr


@pytest.mark.parametrize("unit", list(SERVICES))
def test_service_rules(unit):
    spec = parse_unit(unit_file(unit))
    svc, head = spec["Service"], spec["Unit"]
    assert svc["Type"] == ["notify"]
    assert svc["User"] == ["llamapool"] and svc["Group"] == ["llamapool"]
    assert svc["Restart"] == ["on-failure"]
    assert seconds(svc["RestartSec"][0]) >= 1
    assert seconds(head["StartLimitIntervalSec"][0]) > 0
    assert int(head["StartLimitBurst"][0]) >= 3
    assert seconds(svc["WatchdogSec"][0]) >= 10  # many 1 s heartbeats
    for key, value in {"NoNewPrivileges": "yes", "ProtectSystem": "strict",
                       "ProtectHome": "yes", "PrivateTmp": "yes"}.items():
        assert svc[key] == [value], key
    assert spec["Install"]["WantedBy"] == ["llamapool.target"]
    assert head["PartOf"] == ["llamapool.target"]
    # Only the frontend writes anything, and only in its runtime directory.
    assert "ReadWritePaths" not in svc


def test_frontend_stop_and_metrics_dir():
    svc = parse_unit(unit_file("llamapool-frontend.service"))["Service"]
    assert svc["KillMode"] == ["mixed"]
    config: dict = {}
    exec(compile((UNIT_DIR.parent / "gunicorn.conf.py").read_text(), "gunicorn.conf",
                 "exec"), config)
    example = read_env(UNIT_DIR / "frontend.env.example")
    graceful_s = max(config["graceful_timeout"],
                     int(example["LLAMAPOOL_GRACEFUL_TIMEOUT_S"]))
    assert seconds(svc["TimeoutStopSec"][0]) > graceful_s
    assert svc["RuntimeDirectory"] == ["llamapool/prometheus"]
    assert "PROMETHEUS_MULTIPROC_DIR=/run/llamapool/prometheus" in svc["Environment"]
    (wipe,) = svc["ExecStartPre"]
    assert wipe.split() == ["/usr/bin/find", "${PROMETHEUS_MULTIPROC_DIR}",
                            "-mindepth", "1", "-delete"]


def test_worker_template_and_stop_timeout():
    spec = parse_unit(unit_file("llamapool-worker@1.service"))
    svc = spec["Service"]
    assert svc["EnvironmentFile"] == ["/etc/llamapool/worker-%i.env"]
    assert seconds(svc["TimeoutStopSec"][0]) > WorkerSettings.shutdown_grace_s


@pytest.mark.parametrize("unit, example", list(SERVICES.items()))
def test_execstart_parses_with_the_example_env(unit, example, monkeypatch):
    env = read_env(UNIT_DIR / example)
    for key, value in env.items():
        monkeypatch.setenv(key, value)  # the CLI reads LLAMAPOOL_* defaults
    (command,) = parse_unit(unit_file(unit))["Service"]["ExecStart"]
    argv = expand(command, env)
    assert argv[0] == INSTALLED_BIN
    args = cli.build_parser().parse_args(argv[1:])
    settings = cli.settings_for(args)  # flags over the example's variables
    if args.command == "broker":
        # Network endpoints, with CURVE: the bind policy lets it through.
        BrokerSecurity(settings.curve_secret_key, settings.curve_authorized_workers,
                       settings.curve_authorized_frontends,
                       settings.insecure_plaintext).check_endpoints(
            (settings.frontends_endpoint, settings.workers_endpoint))
        # One directory per role, and never the same one.
        assert settings.curve_authorized_workers.endswith("/workers")
        assert settings.curve_authorized_frontends.endswith("/frontends")
    else:
        assert settings.curve_server_key and settings.curve_secret_key
        assert settings.broker_endpoint.startswith("tcp://")


@pytest.mark.parametrize("unit", list(SERVICES))
def test_restart_prevented_exactly_where_llamapool_up_gives_up(unit):
    """systemd and ``llamapool up`` agree on which exits a restart cannot fix."""
    svc = parse_unit(unit_file(unit))["Service"]
    role = re.match(r"llamapool-(\w+)", unit).group(1)
    (listed,) = svc["RestartPreventExitStatus"]
    assert {int(code) for code in listed.split()} == set(NOT_RESTARTABLE[role])
