"""The broker: the slot ledger between frontends and model workers.

Imports only ``protocol``; it shares nothing with ``workers.model``.
"""
