"""The vocabularies this frontend holds: whose prompts it counts at the door.

A frontend counts a prompt's tokens itself (``frontend.prompt_gate``) and
answers ``/tokenize``, ``/detokenize`` and ``/apply-template`` only with the
model's own vocabulary and chat template. It holds them in one of two ways:

* ``--model PATH`` (``LLAMAPOOL_TOKENIZER_MODEL``): one vocabulary. In a pool
  of one model (or none yet) it is that model's, as it always was; in a
  pool of several it is the model named ``LLAMAPOOL_MODEL_NAME`` or after
  the file, by name or alias.
* ``--models FILE`` (``LLAMAPOOL_MODELS_FILE``, what ``llamapool up --models``
  passes): one per table of the models file, the model named by the table
  (or by one of its ``aliases``), with the table's ``ctx`` and
  ``chat_format`` (else the frontend's ``--ctx`` and chat settings, as the
  workers fall back to ``up``'s flags). The rest of a table (``workers``,
  ``threads``, ...) is the workers' business, checked by ``up``.

A model the frontend holds no vocabulary of is counted by its worker
(generation, ``input_tokens``, ``count_tokens``), and its ``/tokenize``,
``/detokenize`` and ``/apply-template`` are 501 naming the setting, as for a
frontend with no vocabulary at all (docs/llama-cpp-compatibility.md, "Who
answers").
"""

from __future__ import annotations

import os

from frontend.prompt_gate import PromptGate
from frontend.settings import FrontendSettings
from protocol.chat_choice import chat_choice
from protocol.models_tables import read_model_tables
from protocol.payloads import ModelStatus
from protocol.settings import ConfigError


class Vocabularies:
    """Model name (or alias) -> the prompt gate with its vocabulary."""

    def __init__(self, settings: FrontendSettings) -> None:
        #: ``--model``'s gate, and the names it goes by in the pool.
        self.single: PromptGate | None = None
        self._single_names: set[str] = set()
        #: ``--models``' gates: each table's name and aliases -> its gate.
        self._by_name: dict[str, PromptGate] = {}
        self._tables: list[PromptGate] = []
        if settings.tokenizer_model:
            self.single = PromptGate(settings.tokenizer_model,
                                     settings.chat_choice, settings.n_ctx)
            self._single_names = {n for n in (
                settings.model_name, os.path.basename(settings.tokenizer_model))
                if n}
        if settings.models_file:
            self._read(settings)

    def __bool__(self) -> bool:
        return self.single is not None or bool(self._tables)

    def gates(self) -> list[PromptGate]:
        return [self.single] if self.single is not None else list(self._tables)

    def load(self) -> None:
        """Every vocabulary, before the first request (gunicorn's
        ``post_worker_init``)."""
        for gate in self.gates():
            gate.load()

    def gate_for(self, model: str, catalog: dict[str, ModelStatus]
                 ) -> PromptGate | None:
        """The gate of ``model`` (the pool's name, "": none yet) in a pool
        whose models are ``catalog``; None: this frontend has none."""
        entry = catalog.get(model)
        names = {model, *(entry.aliases if entry is not None else ())} - {""}
        if self.single is not None:
            if len(catalog) <= 1 or not model or names & self._single_names:
                return self.single
            return None
        gate = next((self._by_name[n] for n in sorted(names)
                     if n in self._by_name), None)
        if gate is None and len(catalog) <= 1 and len(self._tables) == 1:
            return self._tables[0]  # one model, one table: as with --model
        return gate

    def _read(self, settings: FrontendSettings) -> None:
        path = settings.models_file
        tables = read_model_tables(path)
        for name, table in tables.items():
            gate, aliases = _gate_of(path, name, table, settings)
            self._tables.append(gate)
            for n in (name, *aliases):
                if self._by_name.setdefault(n, gate) is not gate:
                    raise ConfigError(f"models file {path}: model {name!r}: "
                                      f"{n!r} names two models")


def _gate_of(path: str, name: str, table, settings: FrontendSettings
             ) -> tuple[PromptGate, list[str]]:
    """One table's gate and aliases, the keys the frontend reads checked."""
    where = f"models file {path}: model {name!r}"
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: must be a table ([{name}])")
    model_path = table.get("path")
    if not isinstance(model_path, str) or not model_path:
        raise ConfigError(f"{where}: no 'path'")
    if not os.path.isfile(model_path):
        raise ConfigError(f"{where}: path {model_path!r} is not a file")
    aliases = table.get("aliases", [])
    if not isinstance(aliases, list) or not all(
            isinstance(a, str) and a for a in aliases):
        raise ConfigError(f"{where}: aliases must be non-empty strings")
    n_ctx = table.get("ctx", settings.n_ctx)
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 1:
        raise ConfigError(f"{where}: ctx = {n_ctx!r}; a positive integer")
    chat_format = table.get("chat_format")
    if chat_format is not None and not isinstance(chat_format, str):
        raise ConfigError(f"{where}: chat_format = {chat_format!r} has the "
                          "wrong type")
    choice = (chat_choice(chat_format, "", "") if chat_format
              else settings.chat_choice)
    return PromptGate(model_path, choice, n_ctx), aliases
