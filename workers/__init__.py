"""The pool behind the queue: ``workers.broker`` (the broker and its slot
ledger) and ``workers.model`` (a model worker and its engines).

The two share nothing but ``protocol``; neither imports ``frontend`` or the
command (``llamapool``).
"""
