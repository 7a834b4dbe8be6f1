"""Defaults that a frontend and the workers must agree on without asking.

The frontend refuses prompts longer than the workers' context before taking
a slot, so both read the same variable (``LLAMAPOOL_CTX``) and fall back to
the same number.
"""

from __future__ import annotations

#: Tokens of context per slot, when neither a flag nor LLAMAPOOL_CTX says.
N_CTX = 2048
