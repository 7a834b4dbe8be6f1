"""Typed, frozen settings from ``LLAMAPOOL_*`` variables and command-line flags.

Every process (broker, model worker, frontend) has one frozen dataclass of
settings (vLLM's ``envs.py``). Each field is declared with ``setting()``,
which names its environment variable and says what it means, so the
variable, the default and the documentation live on one line. ``load``
builds the object: a flag given on the command line wins over the variable,
which wins over the default. ``defaults_table`` renders the table that each
settings module's docstring carries (a test keeps the two equal).

It lives in ``protocol`` because all three packages use it and ``protocol``
is the one package they may all import.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})
_REQUIRED = "(required)"


class ConfigError(ValueError):
    """A setting is missing or malformed."""


def setting(default: Any, env: str, meaning: str, *, shown: str = "",
            flag: str = "", parse: Callable[[str], Any] | None = None,
            choices: Iterable[str] | None = None, repeat: bool = False,
            const: Any = None, help: str = "", metavar: str | None = None) -> Any:
    """A settings field read from ``env``; ``shown`` overrides the table's default.

    ``flag`` (``--ctx``) makes it a command-line flag too, with the rest as
    its argparse options (``parse``: the value's type; ``repeat``: given more
    than once, a list; ``const``: a flag without a value; ``help``: instead of
    ``meaning``). Commands add it with ``add_flags`` and hand it to a child
    process with ``as_argv``, so a setting is declared once, here.

    Pass ``dataclasses.MISSING`` as ``default`` for a required setting.
    """
    cli = {"type": parse, "choices": list(choices) if choices else None,
           "action": "append" if repeat else "store_const" if const is not None
           else None,
           "const": const, "help": help or None, "metavar": metavar}
    return dataclasses.field(
        default=default,
        metadata={"env": env, "meaning": meaning, "shown": shown, "flag": flag,
                  "cli": {k: v for k, v in cli.items() if v is not None}})


# --- flag values (argparse ``type=``), shared by every command ---------------


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, not {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, not {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must not be negative, not {text}")
    return value


def comma_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


# --- flags ---------------------------------------------------------------------


def add_flags(parser: argparse.ArgumentParser, cls: type,
              names: Iterable[str] | None = None) -> None:
    """Add the flags ``cls`` declares (or only ``names``) to ``parser``.

    A flag is absent from the parsed namespace unless given, so the
    variable and the default apply (``load``); its help names its variable.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in (names if names is not None
                 else [n for n, f in fields.items() if f.metadata.get("flag")]):
        meta = fields[name].metadata
        kwargs = dict(meta["cli"])
        kwargs["help"] = f"{kwargs.get('help', meta['meaning'])} (env {meta['env']})"
        parser.add_argument(meta["flag"], dest=name, default=argparse.SUPPRESS,
                            **kwargs)


def given_flags(args: argparse.Namespace, cls: type,
                names: Iterable[str] | None = None) -> dict[str, Any]:
    """The fields of ``cls`` (or only ``names``) that were given as flags."""
    wanted = set(names) if names is not None else None
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
            if hasattr(args, f.name) and (wanted is None or f.name in wanted)}


def as_argv(cls: type, values: Mapping[str, Any]) -> list[str]:
    """``values`` (field -> value) as the flags ``cls`` declares, for a child
    process's command line; a field without a flag is an error."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    argv: list[str] = []
    for name, value in values.items():
        meta = fields[name].metadata
        if not meta.get("flag"):
            raise ValueError(f"{cls.__name__}.{name} has no flag")
        if "const" in meta["cli"]:
            argv += [meta["flag"]] if value == meta["cli"]["const"] else []
            continue
        if isinstance(value, tuple) and meta["cli"].get("action") != "append":
            # One comma list (``comma_list``): given twice, the last would win.
            argv += [meta["flag"], ",".join(value)]
            continue
        for item in value if isinstance(value, (list, tuple)) else [value]:
            argv += [meta["flag"], str(item)]
    return argv


def _kind(hint: Any) -> tuple[type, bool]:
    """(scalar type, optional) for the hints settings use."""
    optional = False
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        hint = args[0]
        origin = typing.get_origin(hint)
    if origin is tuple:
        return tuple, optional
    return hint, optional


def _parse(name: str, raw: str, hint: Any) -> Any:
    kind, optional = _kind(hint)
    raw = raw.strip()
    if optional and raw == "":
        return None
    if kind is bool:
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ConfigError(f"{name}={raw!r} is not a boolean (1/0, true/false)")
    if kind is tuple:
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    if kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            raise ConfigError(f"{name}={raw!r} is not {kind.__name__}") from None
    return raw


def load(cls: type, env: Mapping[str, str] | None = None,
         flags: Mapping[str, Any] | None = None) -> Any:
    """Build ``cls`` from ``flags`` (field name -> value), then ``env``, then defaults.

    Raises:
        ConfigError: a required setting is missing or a variable is malformed.
    """
    env = os.environ if env is None else env
    flags = flags or {}
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        var = field.metadata.get("env")
        if field.name in flags and flags[field.name] is not None:
            values[field.name] = flags[field.name]
        elif var and env.get(var, "") != "":
            values[field.name] = _parse(var, env[var], hints[field.name])
        elif field.default is dataclasses.MISSING and (
            field.default_factory is dataclasses.MISSING
        ):
            raise ConfigError(f"{var or field.name} is not set")
    return cls(**values)


def to_env(settings: Any) -> dict[str, str]:
    """The settings as ``LLAMAPOOL_*`` variables (for processes started later)."""
    out: dict[str, str] = {}
    for field in dataclasses.fields(settings):
        var = field.metadata.get("env")
        if not var:
            continue
        value = getattr(settings, field.name)
        if value is None:
            out[var] = ""
        elif isinstance(value, bool):
            out[var] = "1" if value else "0"
        elif isinstance(value, tuple):
            out[var] = ",".join(value)
        else:
            out[var] = str(value)
    return out


def defaults_table(cls: type) -> str:
    """The markdown table of variables, defaults and meanings for ``cls``."""
    rows = [("variable", "default", "meaning")]
    for field in dataclasses.fields(cls):
        var = field.metadata.get("env")
        if not var:
            continue
        if field.metadata["shown"]:
            default = field.metadata["shown"]
        elif field.default is dataclasses.MISSING:
            default = _REQUIRED
        elif field.default in ("", None, ()):
            default = "(none)"
        elif isinstance(field.default, bool):
            default = "1" if field.default else "0"
        else:
            default = str(field.default)
        rows.append((var, default, field.metadata["meaning"]))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]

    def line(cells) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(rows[0]), rule, *(line(r) for r in rows[1:])])
