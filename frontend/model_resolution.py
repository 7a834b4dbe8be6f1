"""Which model a request is for: its ``model`` field, by name or alias.

A pool may serve several models (issue 30); the broker gives a job a slot of
the model it names (``GenerationRequest.model``) and no other. The rules, in
order:

* **A name or an alias** of a model in the pool resolves to that model's
  name. The catalog is the pool's ledger as ``/v1/models`` shows it, at
  most ``CATALOG_MAX_AGE_S`` old; a name it does not know is looked up once
  more in a fresh one before it is refused, so a model that just joined is
  found.
* **A name nobody serves** is 404 ``model_not_found`` (OpenAI's shape), and
  takes no slot. Except in a pool of one model: llama-server without router
  mode ignores ``model``, and so does such a pool, as it always did (any
  name gets the one model). Once a second model joins, names must match.
* **A model registered but still loading** (no loaded slot) is 503
  "Loading model".
* **No ``model`` (or "")**: the frontend's ``--default-model`` if set, else
  the only model; with several models and no default it is 400 naming the
  field (llama-server's router: "model name is missing").

The prompt gates (the frontend's ``--model`` or ``--models``, which count
prompt tokens at the door) hold the vocabularies of some models: one counts
for its own model only (``frontend.vocabularies``), and a request for a
model the frontend has no vocabulary of is counted by its worker, as with no
``--model`` at all.
"""

from __future__ import annotations

import dataclasses

from frontend.errors import BadRequest, PoolError, Unavailable
from frontend.interfaces import BrokerClient
from frontend.settings import FrontendSettings
from protocol.errors import ErrorCode
from protocol.payloads import ModelStatus, PoolStatus

#: How stale a catalog a request may be resolved with (a fresh one is asked
#: for a name it lacks, so this only delays noticing a model that left).
CATALOG_MAX_AGE_S = 1.0

_BUSY = ("busy", "cancelling")
_NOT_LOADED = ("loading", "failed")


class ModelNotFound(PoolError):
    """404 ``model_not_found``: no worker serves that name."""

    reject_reason = "model_not_found"

    def __init__(self, name: str) -> None:
        super().__init__(ErrorCode.MODEL_NOT_FOUND,
                         f"The model '{name[:200]}' does not exist")
        self.param = "model"


def catalog(status: PoolStatus | None) -> dict[str, ModelStatus]:
    """Each model of the pool once, by name, with its slots counted from the
    (merged) slots and its aliases and capabilities from the brokers'
    model records (none from an older broker: names alone)."""
    if status is None:
        return {}
    known = {m.name: m for m in status.models}
    counts: dict[str, dict] = {}
    for slot in status.slots:
        c = counts.setdefault(slot.model, {"slots_total": 0, "slots_idle": 0,
                                           "slots_busy": 0, "slots_loading": 0,
                                           "n_ctx": 0})
        if slot.state in _NOT_LOADED:
            c["slots_loading"] += 1
            continue
        c["slots_total"] += 1
        c["slots_idle"] += slot.state == "idle"
        c["slots_busy"] += slot.state in _BUSY
        c["n_ctx"] = min(c["n_ctx"] or slot.n_ctx, slot.n_ctx)
    return {name: dataclasses.replace(known.get(name) or ModelStatus(name), **c)
            for name, c in sorted(counts.items())}


def resolve_in(models: dict[str, ModelStatus], asked: str) -> str | None:
    """The model ``asked`` names in ``models`` (by name, then alias)."""
    if asked in models:
        return asked
    return next((m.name for m in models.values() if asked in m.aliases), None)


class ModelResolver:
    """One endpoint's resolution of ``model`` (the module's rules)."""

    def __init__(self, link: BrokerClient, settings: FrontendSettings) -> None:
        self.link = link
        self.settings = settings
        self._last: dict[str, ModelStatus] = {}
        #: The snapshot the catalog was built from, and the catalog: one
        #: tuple, replaced whole, since the endpoint's threads share it. A
        #: cached snapshot serves many requests; its catalog is built once.
        self._built: tuple[PoolStatus | None, dict[str, ModelStatus]] = (None, {})

    def models(self, fresh: bool = False) -> dict[str, ModelStatus] | None:
        """The pool's catalog (None: no broker answered)."""
        status = self.link.status(self.settings.health_timeout_s,
                                  0.0 if fresh else CATALOG_MAX_AGE_S)
        if status is None:
            return None
        built_from, models = self._built
        if built_from is not status:
            models = catalog(status)
            self._built = (status, models)
        self._last = models
        return models

    def resolve(self, asked: str | None) -> str:
        """The model's name, "" when the pool has none yet (the broker then
        answers as it always did), or ``asked`` itself when no broker
        answered (the broker resolves it, or the submit fails).

        Raises:
            ModelNotFound, Unavailable (loading), BadRequest (several models
            and none named).
        """
        models = self.models()
        if not models:
            # No broker answered, or no worker yet: the broker decides, as
            # it always did (it resolves a name itself; no slot is a 503).
            return (asked or "") if models is None else ""
        name = self._pick(models, asked)
        if name is None or models[name].slots_total == 0:
            # Not known, or only loading, in a catalog up to a second old.
            models = self.models(fresh=True) or models
            name = self._pick(models, asked)
        if name is None:
            if len(models) == 1 and asked:
                return next(iter(models))  # one model: any name, as before
            raise ModelNotFound(asked or self.settings.default_model)
        if models[name].slots_total == 0:
            raise Unavailable(ErrorCode.LOADING_MODEL, "Loading model")
        return name

    def _pick(self, models: dict[str, ModelStatus], asked: str | None
              ) -> str | None:
        if asked:
            return resolve_in(models, asked)
        if self.settings.default_model:
            return resolve_in(models, self.settings.default_model)
        if len(models) > 1:
            raise BadRequest(
                "'model' is required: this pool serves several models ("
                + ", ".join(sorted(models)[:20]) + "), and no --default-model",
                param="model")
        return next(iter(models), None)

    @property
    def seen(self) -> dict[str, ModelStatus]:
        """The catalog the last resolution used."""
        return self._last

    def label(self, model: str) -> str:
        """``model`` as the ``model`` label of metrics (``frontend.metrics``):
        a name of the last catalog, else "" (never a client's own name)."""
        return model if model in self._last else ""

