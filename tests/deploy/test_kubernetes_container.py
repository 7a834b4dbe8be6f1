"""deploy/container/Containerfile, parsed: what the manifests rely on.

The image is built only where a builder runs and ``LLAMAPOOL_BUILD_IMAGE=1``
asks for it (compiling llama.cpp takes many minutes; this machine and CI
have no container builder), so the recipe is checked by reading it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = ROOT / "deploy" / "container" / "Containerfile"


def instructions(path: Path = CONTAINERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined, comments gone."""
    lines = [line for line in path.read_text().splitlines()
             if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def stages() -> dict[str, list[tuple[str, str]]]:
    """Each stage's instructions, by its ``AS`` name."""
    found: dict[str, list[tuple[str, str]]] = {}
    current = None
    for word, rest in instructions():
        if word == "FROM":
            current = found.setdefault(rest.split()[-1], [])
        elif current is not None:
            current.append((word, rest))
    return found


def args_of(stage, word: str) -> list[str]:
    return [rest for w, rest in stage if w == word]


def test_two_stages_build_then_runtime():
    froms = [rest for word, rest in instructions() if word == "FROM"]
    assert [f.split()[-1] for f in froms] == ["build", "runtime"]
    runtime = stages()["runtime"]
    copied = args_of(runtime, "COPY")
    assert any(c.startswith("--from=build /opt/llamapool/venv") for c in copied)


def test_llama_cpp_is_compiled_in_the_build_stage_for_any_cpu():
    build = stages()["build"]
    (cmake,) = [a for a in args_of(build, "ARG") if a.startswith("CMAKE_ARGS=")]
    flags = shlex.split(cmake.partition("=")[2])[0].split()
    # No -march=native: the image runs on other CPUs than the builder's.
    assert "-DGGML_NATIVE=OFF" in flags
    assert {"-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=ON"} <= set(flags)
    (install,) = [r for r in args_of(build, "RUN") if "pip install" in r]
    assert 'CMAKE_ARGS="${CMAKE_ARGS}"' in install
    assert "build-essential" in " ".join(args_of(build, "RUN"))
    # The runtime stage has no compiler.
    assert "build-essential" not in " ".join(args_of(stages()["runtime"], "RUN"))


def test_sources_it_copies_exist():
    for word, rest in instructions():
        if word == "COPY" and not rest.startswith("--from"):
            *sources, _ = rest.split()
            for source in sources:
                assert (ROOT / source).exists(), source


def test_runtime_is_non_root_with_llamapool_as_entry_point():
    runtime = stages()["runtime"]
    (user,) = args_of(runtime, "USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0 and int(gid) != 0
    (entry,) = args_of(runtime, "ENTRYPOINT")
    assert json.loads(entry) == ["llamapool"]
    env = " ".join(args_of(runtime, "ENV"))
    # Nothing written outside /tmp under a read-only root filesystem.
    assert "PYTHONDONTWRITEBYTECODE=1" in env and "HOME=/tmp" in env
    # A non-editable install finds gunicorn's config where it was copied.
    config = re.search(r"LLAMAPOOL_GUNICORN_CONFIG=(\S+)", env).group(1)
    assert any(c.split()[-1] == config and c.split()[0] == "deploy/gunicorn.conf.py"
               for c in args_of(runtime, "COPY"))


def test_manifests_run_it_as_the_user_it_declares():
    (user,) = args_of(stages()["runtime"], "USER")
    uid = int(user.partition(":")[0])
    for name in ("broker", "worker", "frontend"):
        text = (ROOT / "deploy" / "kubernetes" / "base" / f"{name}.yaml").read_text()
        assert f"runAsUser: {uid}" in text, name


@pytest.mark.stack
def test_image_builds_where_a_builder_exists():
    if os.environ.get("LLAMAPOOL_BUILD_IMAGE") != "1":
        pytest.skip("set LLAMAPOOL_BUILD_IMAGE=1 to build the image (minutes)")
    podman = shutil.which("podman")
    if podman is None:
        pytest.skip("no podman on this machine")
    tag = "localhost/llamapool-test:latest"
    subprocess.run([podman, "build", "-f", str(CONTAINERFILE), "-t", tag, str(ROOT)],
                   check=True, timeout=3600)
    # Read-only root, as the manifests run it: the probe still starts.
    result = subprocess.run(
        [podman, "run", "--rm", "--read-only", "--tmpfs", "/tmp", tag,
         "probe", "worker", "--port", "1"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "not ok" in result.stdout
