"""``llamapool up --models FILE``: several models on one machine (issue 30).

A TOML file with one table per model; the table's name is the model's name
in the pool (what requests give as ``model``)::

    [chat]
    path = "/srv/models/gemma-3-270m-q4_k_m.gguf"
    aliases = ["gemma", "default"]
    workers = 2
    ctx = 4096
    chat_format = "gemma"
    default = true          # the model of requests that name none

    [code]
    path = "/srv/models/qwen2.5-coder-0.5b-q8_0.gguf"
    workers = 1
    threads = 4
    cache_ram = 1024
    gpu_layers = 0
    repack = "auto"
    temp = 0.2              # defaults for what a request leaves out:
    n_predict = 512         # n_predict, seed, temp, top_k, top_p, min_p and
                            # the repeat, presence and frequency penalties

Every key but ``path`` is optional: ``workers`` falls back to ``up``'s
``--workers``, the others to ``up``'s own flags (and then to the workers'
defaults). A mistake (an unknown key, a wrong type, a missing file, a value
the worker would refuse, an alias two models share) is a ``ConfigError``
naming the model, which ``up`` turns into exit code 2 before it starts
anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from protocol import limits
from protocol.models_tables import read_model_tables
from protocol.settings import ConfigError, load
from workers.model.settings import WorkerSettings

#: Table key -> (WorkerSettings field, the types the key takes).
WORKER_KEYS: dict[str, tuple[str, tuple[type, ...]]] = {
    "ctx": ("n_ctx", (int,)),
    "chat_format": ("chat_format", (str,)),
    "threads": ("n_threads", (int, str)),
    "cache_ram": ("cache_ram_mib", (int,)),
    "gpu_layers": ("gpu_layers", (int,)),
    "repack": ("repack", (str,)),
    # Defaults for what a request leaves out (llama-server's -n, --temp, ...).
    "n_predict": ("n_predict", (int,)),
    "seed": ("seed", (int,)),
    "temp": ("temperature", (int, float)),
    "top_k": ("top_k", (int,)),
    "top_p": ("top_p", (int, float)),
    "min_p": ("min_p", (int, float)),
    "repeat_penalty": ("repeat_penalty", (int, float)),
    "presence_penalty": ("presence_penalty", (int, float)),
    "frequency_penalty": ("frequency_penalty", (int, float)),
}
OTHER_KEYS = {"path": (str,), "aliases": (list,), "workers": (int,),
              "default": (bool,)}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One table: a model and how ``up`` runs its workers."""

    name: str
    path: str
    aliases: tuple[str, ...]
    workers: int
    default: bool
    #: WorkerSettings field -> value, for ``protocol.settings.as_argv``.
    worker_flags: dict


def load_models_file(path: str, default_workers: int) -> list[ModelSpec]:
    """The file's models, checked (module doc).

    Raises:
        ConfigError: naming the file, and the model where one is at fault.
    """
    tables = read_model_tables(path)
    specs = [_spec(path, name, table, default_workers)
             for name, table in tables.items()]
    _check_pool(path, specs)
    return specs


def _spec(path: str, name: str, table, default_workers: int) -> ModelSpec:
    where = f"models file {path}: model {name!r}"
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: must be a table ([{name}])")
    for key, value in table.items():
        kinds = OTHER_KEYS.get(key) or WORKER_KEYS.get(key, (None, None))[1]
        if kinds is None:
            known = ", ".join(sorted({*OTHER_KEYS, *WORKER_KEYS}))
            raise ConfigError(f"{where}: unknown key {key!r} (known: {known})")
        if isinstance(value, bool) and bool not in kinds or not isinstance(
                value, kinds):
            raise ConfigError(f"{where}: {key} = {value!r} has the wrong type")
    model_path = table.get("path")
    if not model_path:
        raise ConfigError(f"{where}: no 'path'")
    if not os.path.isfile(model_path):
        raise ConfigError(f"{where}: path {model_path!r} is not a file")
    aliases = table.get("aliases", [])
    if not all(isinstance(a, str) and a for a in aliases):
        raise ConfigError(f"{where}: aliases must be non-empty strings")
    if len(name) > limits.MAX_NAME_CHARS:
        raise ConfigError(f"{where}: the name is longer than "
                          f"{limits.MAX_NAME_CHARS} characters")
    workers = table.get("workers", default_workers)
    if workers < 1:
        raise ConfigError(f"{where}: workers = {workers}; at least 1")
    flags = {field: (str(table[key]) if field == "n_threads" else table[key])
             for key, (field, _) in WORKER_KEYS.items() if key in table}
    _parse_as_flags(where, flags)
    flags["model_name"] = name
    if aliases:
        flags["aliases"] = ",".join(aliases)
    try:
        # What the worker would refuse at its start, refused now.
        load(WorkerSettings, {}, {**flags, "broker_endpoint": "ipc://check",
                                  "model_path": model_path})
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return ModelSpec(name, model_path, tuple(aliases), workers,
                     bool(table.get("default", False)), flags)


def _check_pool(path: str, specs: list[ModelSpec]) -> None:
    """Names that would mean two models, and more than one default."""
    owner: dict[str, str] = {}
    for spec in specs:
        for name in (spec.name, *spec.aliases):
            if owner.setdefault(name, spec.name) != spec.name:
                raise ConfigError(
                    f"models file {path}: model {spec.name!r}: {name!r} "
                    f"already names model {owner[name]!r}")
    defaults = [s.name for s in specs if s.default]
    if len(defaults) > 1:
        raise ConfigError(f"models file {path}: models {defaults} are all "
                          "'default'; one at most")


def _parse_as_flags(where: str, flags: dict) -> None:
    """Each value through its flag's own parser (``--ctx 0`` is refused by
    ``positive_int``, not by the settings object)."""
    fields = {f.name: f for f in dataclasses.fields(WorkerSettings)}
    for key, (field, _) in WORKER_KEYS.items():
        if field not in flags:
            continue
        cli = fields[field].metadata["cli"]
        parse, choices = cli.get("type"), cli.get("choices")
        try:
            value = parse(str(flags[field])) if parse else flags[field]
        except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
            raise ConfigError(f"{where}: {key} = {flags[field]!r}: {exc}") from None
        if choices and value not in choices:
            raise ConfigError(f"{where}: {key} = {value!r}: one of "
                              f"{', '.join(choices)}")
