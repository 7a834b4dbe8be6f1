"""The pool behind the queue: the broker with its slot ledger, and model workers."""
