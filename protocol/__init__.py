"""The wire between frontends, the broker and model workers.

Imports nothing from ``frontend`` or ``workers``.
"""
