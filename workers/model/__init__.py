"""A model worker: one engine, one slot, one job at a time.

Imports only ``protocol``; it shares nothing with ``workers.broker``.
"""
