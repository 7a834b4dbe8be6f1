"""The tables in ``docs/`` that are generated from the code.

Each generated block in a page sits between two marker lines::

    <!-- generated: errors -->
    ...
    <!-- end generated -->

``python -m llamapool.doc_tables`` rewrites every block from what the code
says now (``--check``: only report the stale ones, exit 1 if any), and
``tests/test_doc_tables.py`` fails while a block differs, so a new error
code, setting, flag or exit code cannot go undocumented.

The sources: ``frontend.errors.HTTP_FORMS`` and ``protocol.errors.ErrorCode``
(the error table; each code's meaning is the comment beside or above it),
the three settings classes through ``protocol.settings.defaults_table``, the
flags ``llamapool.cli`` binds to their fields, and ``llamapool.exit_codes``.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import inspect
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from frontend.errors import HTTP_FORMS, UNKNOWN_FORM
from frontend.settings import FrontendSettings
from llamapool import cli
from llamapool.exit_codes import NOT_RESTARTABLE, ExitCode
from protocol.errors import ErrorCode
from protocol.settings import defaults_table
from workers.broker.settings import BrokerSettings
from workers.model.settings import WorkerSettings

#: The checkout's root (``docs/`` lives there, not in an installed package).
ROOT = Path(__file__).resolve().parents[1]

_BLOCK = re.compile(
    r"(?P<open><!-- generated: (?P<name>[\w-]+) -->\n)"
    r"(?P<body>.*?)"
    r"(?P<close><!-- end generated -->)",
    re.DOTALL,
)
#: An enum member's line: ``NAME = value``, and its comment if it has one.
_MEMBER = re.compile(r"^\s*(?P<name>[A-Z][A-Z0-9_]*)\s*=\s*(?P<rest>.*)$")
_TRAILING_COMMENT = re.compile(r"""^(?:"[^"]*"|'[^']*'|[^#'"])*#:?\s*(.*)$""")


def member_comments(cls: type[enum.Enum]) -> dict[str, str]:
    """Each member's one-line meaning, from ``cls``'s source.

    The comment on the member's own line wins; else the comment lines right
    above it (``#:`` or ``#``), joined. A member with neither gets "".
    """
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):  # no source (a frozen build): no meanings
        return {}
    found: dict[str, str] = {}
    above: list[str] = []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("#:").strip())
            continue
        member = _MEMBER.match(line)
        if member is not None:
            trailing = _TRAILING_COMMENT.match(member["rest"])
            text = trailing[1] if trailing else " ".join(above)
            found[member["name"]] = _markdown(text)
        above = []
    return found


def _markdown(text: str) -> str:
    """A comment as one table cell: rST ``code`` to Markdown, no bare pipes."""
    return text.replace("``", "`").replace("|", "\\|").strip()


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def error_table() -> str:
    """Every domain code with its HTTP status, OpenAI error type and meaning,
    in ``HTTP_FORMS``' order (grouped by status)."""
    meanings = member_comments(ErrorCode)
    codes = list(HTTP_FORMS) + [c for c in ErrorCode if c not in HTTP_FORMS]
    rows = []
    for code in codes:
        form = HTTP_FORMS.get(code, UNKNOWN_FORM)
        rows.append((f"`{code.value}`", str(form.status), f"`{form.type}`",
                     meanings.get(code.name, "")))
    rows.append(("any other code (a newer peer's)", str(UNKNOWN_FORM.status),
                 f"`{UNKNOWN_FORM.type}`", "shown as a plain server error"))
    return _table(("code", "HTTP status", "error type", "meaning"), rows)


def _subcommand(name: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise LookupError(f"llamapool has no subcommand {name!r}")


def flags_table(command: str, cls: type) -> str:
    """The flags of ``llamapool COMMAND`` that set a field of ``cls``, with
    the variable each one overrides."""
    env = {f.name: f.metadata.get("env") for f in dataclasses.fields(cls)}
    rows = []
    for action in _subcommand(command)._actions:
        if action.option_strings and env.get(action.dest):
            flags = ", ".join(f"`{flag}`" for flag in action.option_strings)
            rows.append((flags, f"`{env[action.dest]}`"))
    return _table(("flag", "variable"), rows)


def settings_block(command: str, cls: type) -> str:
    """One process's variables and defaults, then the flags that set them."""
    return (defaults_table(cls) + "\n\n"
            + f"Flags of `llamapool {command}`:\n\n" + flags_table(command, cls))


def exit_code_table() -> str:
    """Every exit code, its meaning, and which processes are not restarted
    after it (by the systemd units and by ``llamapool up``)."""
    meanings = member_comments(ExitCode)
    rows = []
    for code in ExitCode:
        final = [name for name, codes in NOT_RESTARTABLE.items() if code in codes]
        rows.append((str(code.value), f"`{code.name}`", meanings.get(code.name, ""),
                     ", ".join(final) or "-"))
    return _table(("code", "name", "meaning", "not restarted (process)"), rows)


#: Block name -> (page under ``docs/``, renderer).
BLOCKS: dict[str, tuple[str, Callable[[], str]]] = {
    "errors": ("api.md", error_table),
    "worker-settings": ("configuration.md",
                        lambda: settings_block("worker", WorkerSettings)),
    "broker-settings": ("configuration.md",
                        lambda: settings_block("broker", BrokerSettings)),
    "frontend-settings": ("configuration.md",
                          lambda: settings_block("frontend", FrontendSettings)),
    "exit-codes": ("configuration.md", exit_code_table),
}


def generated_blocks(text: str) -> dict[str, str]:
    """The generated blocks of a page: name -> body between the markers."""
    return {m["name"]: m["body"] for m in _BLOCK.finditer(text)}


def rendered(name: str) -> str:
    """What block ``name``'s body must be now."""
    return "\n" + BLOCKS[name][1]().rstrip("\n") + "\n\n"


def regenerate(text: str) -> str:
    """``text`` with every known generated block rendered again.

    Raises:
        KeyError: a block names no known table.
    """
    return _BLOCK.sub(
        lambda m: m["open"] + rendered(m["name"]) + m["close"], text)


def pages() -> dict[str, list[str]]:
    """Page under ``docs/`` -> the block names it must hold."""
    out: dict[str, list[str]] = {}
    for name, (page, _render) in BLOCKS.items():
        out.setdefault(page, []).append(name)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Rewrite the generated blocks in ``docs/`` (``--check``: report only)."""
    parser = argparse.ArgumentParser(prog="python -m llamapool.doc_tables",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a block is stale")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs",
                        help="the docs folder (default: %(default)s)")
    args = parser.parse_args(argv)
    stale = []
    for page, names in pages().items():
        path = args.docs / page
        text = path.read_text(encoding="utf-8")
        missing = set(names) - set(generated_blocks(text))
        if missing:
            print(f"{path}: no block for {', '.join(sorted(missing))}",
                  file=sys.stderr)
            return 2
        new = regenerate(text)
        if new != text:
            stale.append(path)
            if not args.check:
                path.write_text(new, encoding="utf-8")
    verb = "stale" if args.check else "rewritten"
    for path in stale:
        print(f"{verb}: {path}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
