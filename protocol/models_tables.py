"""Reading a models file (``llamapool up --models``, ``llamapool frontend
--models``): its TOML tables, one per model, before either side checks the
fields it uses (``llamapool.models_file`` for the workers,
``frontend.vocabularies`` for the frontend's vocabularies)."""

from __future__ import annotations

import tomllib

from protocol.settings import ConfigError


def read_model_tables(path: str) -> dict:
    """The file's tables, by model name, unchecked.

    Raises:
        ConfigError: unreadable, not TOML, or without a table.
    """
    try:
        with open(path, "rb") as f:
            tables = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"models file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"models file {path}: not TOML: {exc}") from None
    if not tables:
        raise ConfigError(f"models file {path}: no model tables")
    return tables
