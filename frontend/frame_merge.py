"""TOKEN frames that wait for a client go out as one.

A job's frames queue at the frontend while its client (or the request
thread that writes to it) is behind: a client reading slowly, a frontend
whose threads are short of CPU. Handing them out one by one costs one
event, one write and one wake-up of the client each; merged, the backlog
costs one of each, so a frontend that falls behind catches up instead of
staying behind. A frontend that keeps up never finds a second frame
waiting, and sends each token the moment it arrives, as before: this is
vLLM's ``--stream-interval`` only while the client is behind, never a delay.

Every shape a client sees takes a frame of several tokens already (the
worker holds text back at a possible stop string and sends it as one
frame): the text, ``n_tokens``, one log-probability entry and one token id
per token. An embedding's frame is one input's vector, and is never merged.
"""

from __future__ import annotations

import dataclasses

from protocol import messages


def merged(first: messages.Token, then: messages.Token) -> messages.Token | None:
    """One frame for ``first`` followed by ``then``; None where the two do
    not merge (an embedding, or frames that disagree on what they carry:
    a peer that lied, or a worker that changed mid-job)."""
    if first.embedding or then.embedding:
        return None
    if (bool(first.token_ids) != bool(then.token_ids)
            or bool(first.logprobs) != bool(then.logprobs)):
        return None
    return dataclasses.replace(
        first,
        text=first.text + then.text,
        n_tokens=first.n_tokens + then.n_tokens,
        logprobs=first.logprobs + then.logprobs,
        # The job's timings so far: the later frame's are the newer.
        timings=then.timings if then.timings is not None else first.timings,
        token_ids=first.token_ids + then.token_ids,
    )
