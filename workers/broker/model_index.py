"""Which models the ledger's workers serve, under which names.

A pool may hold workers of several models (issue 30). Each job names its
model (``GenerationRequest.model``), and the ledger gives it only a slot of
that model, so the index keeps each model's workers apart: ``slots_of`` is
what ``Ledger.assign`` looks through, not every worker.

A model is known by its name (``Ready.model``) and by the aliases its
workers give it (``--alias``); a name resolves to one model or none. A
worker whose name or aliases would make a name mean two models is refused
(``conflict``), as is a worker of one model more than ``MAX_MODELS``:
either would make routing ambiguous or the STATUS reply unbounded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol import limits
from protocol.payloads import CAPABILITIES, ModelStatus

if TYPE_CHECKING:
    from workers.broker.ledger import WorkerSlot

_BUSY = ("busy", "cancelling")
_NOT_LOADED = ("loading", "failed")


class ModelIndex:
    """Model name -> its workers, and alias -> model name."""

    def __init__(self) -> None:
        self._workers: dict[str, dict[bytes, WorkerSlot]] = {}
        self._aliases: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._workers)

    def __contains__(self, name: str) -> bool:
        return name in self._workers

    # --- membership (the ledger calls these as workers come and go) -----------

    def add(self, slot: WorkerSlot) -> None:
        name = slot.info.model
        self._workers.setdefault(name, {})[slot.identity] = slot
        for alias in slot.info.aliases:
            if alias != name:
                self._aliases[alias] = name

    def discard(self, slot: WorkerSlot) -> None:
        name = slot.info.model
        workers = self._workers.get(name)
        if workers is None or workers.pop(slot.identity, None) is None:
            return
        if not workers:
            del self._workers[name]
        # An alias lives while any worker of its model still gives it.
        held = {a for w in workers.values() for a in w.info.aliases}
        for alias in slot.info.aliases:
            if alias not in held and self._aliases.get(alias) == name:
                del self._aliases[alias]

    def conflict(self, identity: bytes, name: str, aliases: list[str]) -> str:
        """Why a worker serving ``name`` under ``aliases`` may not join ("":
        it may). A worker re-registering is checked against the others."""
        if len(aliases) > limits.MAX_ALIASES:
            return (f"{len(aliases)} aliases for model {name!r}; at most "
                    f"{limits.MAX_ALIASES}")
        if name not in self._workers and len(self._workers) >= limits.MAX_MODELS:
            return (f"the broker serves {limits.MAX_MODELS} models already; "
                    f"model {name!r} is one too many")
        if self._aliases.get(name, name) != name:
            return (f"model name {name!r} is an alias of model "
                    f"{self._aliases[name]!r}")
        for alias in aliases:
            owner = self.resolve(alias)
            if owner is not None and owner != name and set(
                    self._workers[owner]) != {identity}:
                return f"alias {alias!r} already names model {owner!r}"
        return ""

    # --- lookups ----------------------------------------------------------------

    def resolve(self, name: str) -> str | None:
        """The model ``name`` names (itself, or the model it is an alias
        of), or None if no worker serves one by that name."""
        if name in self._workers:
            return name
        return self._aliases.get(name)

    def slots_of(self, name: str) -> list[WorkerSlot]:
        return list(self._workers.get(name, {}).values())

    def statuses(self) -> list[ModelStatus]:
        """Each model once, for the STATUS reply."""
        out = []
        for name in sorted(self._workers):
            slots = list(self._workers[name].values())
            loaded = [s for s in slots if s.state not in _NOT_LOADED]
            aliases = sorted({a for s in slots for a in s.info.aliases} - {name})
            # What every loaded slot can do: a job may land on any of them.
            caps = (set.intersection(*(set(s.info.capabilities) for s in loaded))
                    if loaded else set())
            out.append(ModelStatus(
                name=name, aliases=aliases,
                capabilities=_ordered(caps),
                n_ctx=min((s.info.n_ctx for s in loaded), default=0),
                slots_total=len(loaded),
                slots_idle=sum(1 for s in loaded
                               if s.state == "idle" and not s.draining),
                slots_busy=sum(1 for s in loaded if s.state in _BUSY),
                slots_loading=len(slots) - len(loaded)))
        return out


def _ordered(caps: set[str]) -> list[str]:
    return ([c for c in CAPABILITIES if c in caps]
            + sorted(caps - set(CAPABILITIES)))
