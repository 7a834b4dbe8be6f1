"""Which worker registrations are restarts: deaths per host, bounded.

A worker that registers on a host where one died (and was not yet replaced)
counts as a restart (``llamapool_worker_restarts_total``). The broker keeps
pending deaths per host name, and host names come from peers: 2 000 fake
workers with unique 10 KB names used to leave 2 000 entries behind for good.
Host names are now capped at 255 characters on the wire
(``protocol.limits``), and this table holds at most ``max_hosts`` hosts
(the oldest death is forgotten first) and at most ``max_hosts`` pending
deaths per host: a pool never has more workers than that
(``--max-workers``), so a real restart is never missed for lack of room.
"""

from __future__ import annotations

import collections


class HostDeaths:
    """Pending worker deaths per host name, bounded in hosts and counts."""

    def __init__(self, max_hosts: int) -> None:
        self.max_hosts = max_hosts
        self._pending: collections.OrderedDict[str, int] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._pending)

    def died(self, host: str) -> None:
        """A worker on ``host`` died."""
        count = self._pending.pop(host, 0)
        self._pending[host] = min(count + 1, self.max_hosts)  # newest last
        while len(self._pending) > self.max_hosts:
            self._pending.popitem(last=False)

    def registered(self, host: str) -> bool:
        """A worker registered on ``host``; True if it replaces a dead one."""
        count = self._pending.get(host, 0)
        if count == 0:
            return False
        if count == 1:
            del self._pending[host]  # no zero entries left behind
        else:
            self._pending[host] = count - 1
        return True
