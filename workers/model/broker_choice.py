"""Which broker a worker registers with, and where it goes when that one dies.

The pool's ledgers are sharded (docs/operations.md, "Several brokers"): a worker is in
exactly one broker's ledger at a time, because it has exactly one DEALER,
to one broker. That is what keeps a slot from being leased twice: no second
broker ever hears this worker's READY while the first may still lease it.

Workers spread over the list by a stable hash of their name, so a fleet
started with the same ``--broker`` list lands evenly without coordination.
When the current broker is silent for the liveness window, the worker moves
to the next one in the list (wrapping around), keeping its model loaded; a
broker that merely restarted says DISCONNECT instead, and the worker stays.
"""

from __future__ import annotations

import zlib


class BrokerChoice:
    """The broker a worker talks to now, among ``endpoints``."""

    def __init__(self, endpoints: tuple[str, ...], worker_name: str) -> None:
        if not endpoints:
            raise ValueError("a worker needs at least one broker endpoint")
        self.endpoints = endpoints
        # crc32, not hash(): str hashes are salted per process, and the
        # spread must be the same on every start.
        self._index = zlib.crc32(worker_name.encode()) % len(endpoints)
        #: How many times the worker moved to another broker.
        self.moves = 0

    @property
    def current(self) -> str:
        return self.endpoints[self._index]

    def broker_lost(self) -> str:
        """The current broker went silent: the endpoint to try next.

        With one broker that is the same one (the link redials it).
        """
        if len(self.endpoints) > 1:
            self._index = (self._index + 1) % len(self.endpoints)
            self.moves += 1
        return self.current
