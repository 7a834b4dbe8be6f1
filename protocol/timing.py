"""Timing constants shared by every peer on the wire.

Each name carries its unit. These are defaults; every process can override
them from its settings (CLI flag or ``LLAMAPOOL_*`` variable).
"""

from __future__ import annotations

#: How often each side sends a HEARTBEAT when it has nothing else to send.
HEARTBEAT_INTERVAL_S = 1.0

#: A peer is dead after this many intervals without any message from it.
HEARTBEAT_LIVENESS = 3

#: How long a frontend waits for the broker to accept or refuse a SUBMIT.
SUBMIT_TIMEOUT_S = 5.0

#: TOKEN frames a worker may have in flight per job before it pauses.
#: The frontend hands credit back as its HTTP client consumes frames, so a slow
#: reader pauses generation instead of growing buffers (see docs/operations.md, "Flow
#: control").
CREDIT_WINDOW_FRAMES = 256

#: A paused job (no credit) is cancelled after this long without new credit.
STALL_TIMEOUT_S = 60.0

#: Lowest and highest Retry-After the broker will suggest with NO_SLOT.
RETRY_AFTER_MIN_S = 1.0
RETRY_AFTER_MAX_S = 60.0

#: A job cancelled this long ago and still not ended is stuck in native code
#: (a decode that never returns): the broker drops its worker from the
#: ledger, and the worker ends its own process so that its supervisor starts
#: a fresh one. A real worker ends a cancelled job at its next token; the
#: longest legitimate wait is a prompt's prefill, which llama.cpp runs with
#: no cancel check (docs/operations.md, "Stuck workers").
CANCEL_TIMEOUT_S = 30.0
