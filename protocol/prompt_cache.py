"""What a worker says about its prompt-state cache (``workers.model.prompt_cache``).

A worker keeps many conversations' KV states in RAM. After every job (before
its terminal frame, so the broker knows before the slot is free again) it
sends a CACHE_REPORT: the prefix fingerprints (``protocol.prefix``) of each
state it can restore, the live KV sequence first, and its cache's figures for
``/slots`` and ``/metrics``. The broker routes a SUBMIT to the idle worker
whose report covers the most of the prompt's blocks.
"""

from __future__ import annotations

from typing import Annotated

from protocol.records import COUNT, WireRecord, wire_record


@wire_record
class PromptCacheStatus(WireRecord):
    """One worker's prompt-state cache, as ``/slots`` shows it.

    ``hits``: jobs that restored a cached state; ``misses``: jobs with a
    prompt of at least one block that found nothing to restore and did not
    continue the live sequence; ``evictions``: states dropped to stay inside
    ``bytes_limit``; ``dropped``: states refused or discarded because they
    were larger than the limit or failed to restore.
    """

    states: Annotated[int, COUNT] = 0
    bytes_used: Annotated[int, COUNT] = 0
    bytes_limit: Annotated[int, COUNT] = 0
    hits: Annotated[int, COUNT] = 0
    misses: Annotated[int, COUNT] = 0
    evictions: Annotated[int, COUNT] = 0
    dropped: Annotated[int, COUNT] = 0
