"""The list of brokers a frontend or worker reaches (``--broker``, repeated or
a comma list; ``LLAMAPOOL_BROKER`` as a comma list).

Several brokers share one pool (docs/operations.md, "Several brokers"): every frontend
connects to all of them, every worker to one at a time. Both read the same
setting, so both parse it here.
"""

from __future__ import annotations

from protocol.settings import ConfigError


def split_endpoints(text: str) -> tuple[str, ...]:
    """The endpoints in ``text``, in order.

    Raises:
        ConfigError: the list is empty or names one endpoint twice (a
            frontend would count that broker's slots twice).
    """
    endpoints = tuple(part.strip() for part in text.split(",") if part.strip())
    if not endpoints:
        raise ConfigError("LLAMAPOOL_BROKER names no broker endpoint")
    seen: set[str] = set()
    for endpoint in endpoints:
        if endpoint in seen:
            raise ConfigError(f"LLAMAPOOL_BROKER names {endpoint} twice")
        seen.add(endpoint)
    return endpoints
