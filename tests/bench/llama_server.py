"""llama.cpp's own ``llama-server``, built from the very llama.cpp the
workers run, for side-by-side benchmarks.

    python -m tests.bench.llama_server      # build (once) and print its path
    make llama-server                       # the same

llama-cpp-python ships only as an sdist that vendors llama.cpp, so the
source of the installed version is one ``pip download`` away. It is built
once into ``~/.cache/llamapool/llama-server-<version>/`` (about 10 minutes on
2 cores) and reused by every later benchmark: same commit, same compiler
flags as a default CPU build, so the comparison is fair.
"""

from __future__ import annotations

import glob
import importlib.metadata
import os
import subprocess
import sys
import tarfile
from pathlib import Path

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llamapool"


def version() -> str:
    return importlib.metadata.version("llama-cpp-python")


def binary_path() -> Path:
    return CACHE / f"llama-server-{version()}" / "build" / "bin" / "llama-server"


def _source_dir(work: Path) -> Path:
    """The vendored llama.cpp of the installed llama-cpp-python's sdist."""
    found = glob.glob(str(work / "llama_cpp_python-*" / "vendor" / "llama.cpp"))
    if found:
        return Path(found[0])
    subprocess.run(
        [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version()}",
         "--no-deps", "--no-binary", ":all:", "--dest", str(work)],
        check=True)
    (sdist,) = work.glob("llama_cpp_python-*.tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(work, filter="data")
    return _source_dir(work)


def build() -> Path:
    """Build ``llama-server`` unless the cache has it; return its path."""
    binary = binary_path()
    if binary.exists():
        return binary
    work = binary.parents[2]
    work.mkdir(parents=True, exist_ok=True)
    source = _source_dir(work)
    build_dir = binary.parents[1]
    subprocess.run(
        ["cmake", "-S", str(source), "-B", str(build_dir),
         "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
         "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"],
        check=True)
    subprocess.run(
        ["cmake", "--build", str(build_dir), "--target", "llama-server",
         "-j", str(os.cpu_count() or 1)],
        check=True)
    return binary


def argv(model: str, *, slots: int, n_threads: int, port: int,
         ctx: int = 2048) -> list[str]:
    """``llama-server`` with ``slots`` parallel slots of ``ctx`` tokens each
    (its ``-c`` is the total, split between the slots)."""
    return [str(build()), "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "-np", str(slots), "-c", str(ctx * slots),
            "-t", str(n_threads), "-tb", str(n_threads), "--no-webui"]


def main() -> int:
    print(build())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
