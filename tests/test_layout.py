"""Imports run one way: ``protocol <- workers <- frontend <- llamapool``.

Read from the source with ``ast`` (deferred imports inside functions count
too), so a cycle cannot creep back in through a lazy import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("protocol", "workers", "frontend", "llamapool")

#: What each package may import from the project, besides itself.
ALLOWED = {
    "protocol": set(),
    "workers.broker": {"protocol"},
    "workers.model": {"protocol"},
    "frontend": {"protocol"},
    "llamapool": {"protocol", "workers", "frontend"},
}

#: The frontend's imports from ``workers``, each needed on purpose:
#: the pool's ``llama_*`` series are rendered from the broker's snapshot by
#: the same collector the broker's own /metrics uses (and llama.cpp's
#: ``llamacpp:*`` series by the broker's renderer), the prompt gate
#: counts tokens with the workers' own prompt builder, and a JSON schema or
#: grammar is converted and checked with the workers' own grammar code, so
#: the two never differ; an infill prompt is laid out next to the prompt
#: builder whose tokenizer it uses (the native ``/infill``).
FRONTEND_USES_WORKERS = {"workers.broker.metrics", "workers.model.prompting",
                         "workers.model.grammar", "workers.model.infill",
                         "workers.broker.llamacpp_metrics"}
#: ... and the one frontend module that imports ``workers.model``.
FRONTEND_MODEL_DOOR = "frontend/model_code.py"


def package_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] == "workers" and len(parts) > 2:
        return f"workers.{parts[1]}"
    return parts[0]


def project_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {n for n in names if n.split(".")[0] in PROJECT}
    return found


SOURCES = sorted(p for pkg in PROJECT for p in (ROOT / pkg).rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_run_one_way(path):
    own = package_of(path)
    for name in project_imports(path):
        if name == own or name.startswith(own + "."):
            continue
        if own == "frontend" and name in FRONTEND_USES_WORKERS:
            assert not name.startswith("workers.model") or str(
                path.relative_to(ROOT)) == FRONTEND_MODEL_DOOR, (
                f"{path.relative_to(ROOT)} imports {name}: the frontend reaches "
                f"the model code through {FRONTEND_MODEL_DOOR} only")
            continue
        assert name.split(".")[0] in ALLOWED[own], (
            f"{path.relative_to(ROOT)} imports {name}")


def test_workers_has_no_modules_of_its_own():
    """``workers/`` only holds the two packages that share nothing."""
    loose = [p.name for p in (ROOT / "workers").glob("*.py") if p.name != "__init__.py"]
    assert loose == []
